"""What users see of a running pipeline: the status ``shoal status`` prints and ``shoal up`` shows.

``status`` builds it, pure, from the monitor's ``Snapshot``; a later browser view lives here too.
Sits above ``shoal.scaler`` (whose monitor it reads), below ``shoal.runtime``; never imports MQTT.
"""
