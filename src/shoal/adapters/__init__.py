"""Device-native ingest: read what devices already publish, act as a shoal gateway for it.

``shoal adapt --mapping FILE`` runs an ``Adapter``: it joins a shared subscription on the
mapping's device topics (persistent session, QoS 1, manual acknowledgement), decodes JSON
objects, JSON arrays, raw values and Sparkplug B into measurement rows, and hands them to a
``shoal.gateway.Gateway`` (seq, spool, confirmations, re-sends). A device message is
acknowledged only once its rows are on disk (``intake``: an append-only log, sealed into the
gateway spool in batches); refused messages are dead-lettered with a
specific reason.

Depends on ``shoal.gateway``, ``shoal.schemas``, ``shoal.processors`` (dead-letter records)
and the broker seam; never on the runtime, the load tester or the MQTT libraries directly.
"""

from shoal.adapters.adapter import Adapter, AdapterConfig, AdapterStats
from shoal.adapters.decode import Decoder, Row
from shoal.adapters.mapping import Mapping, load_mapping, parse_mapping

__all__ = [
    "Adapter",
    "AdapterConfig",
    "AdapterStats",
    "Decoder",
    "Mapping",
    "Row",
    "load_mapping",
    "parse_mapping",
]
