"""The control plane: pipelines deployed, updated and deleted at run time over MQTT.

``canonical`` (a spec's canonical form and content hash), ``messages`` (request, result,
pipeline document), ``registry`` (the pure state machine) and ``service`` (the asyncio
component that keeps the registry as retained documents, ``shoal control``); ``client`` is
what ``shoal pipeline`` uses. Depends on ``schemas``, ``processors``, ``clock`` and the
``Session`` Protocol; never on ``runtime``, ``scaler``, ``archive`` or ``gateway``.
"""
