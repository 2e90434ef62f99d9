"""The research's baseline, rebuilt: Flask + Waitress (one thread) + pandas, JSON over HTTP.

``app`` is the processing service (one POST route that analyses a batch with pandas),
``server`` runs it under Waitress in its own process, ``driver`` plays the gateways (one
open-loop HTTP sender per gateway, fed by the same synthetic sensors as ``shoal simulate``),
and ``bench`` runs the two together and reports what ``shoal bench pipeline`` reports for
shoal. Flask and Waitress are the optional ``bench`` extra, imported only when used.

Never imported by shoal's pipeline processes.
"""
