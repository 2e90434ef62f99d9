"""The gateway library: batch measurements, spool them until confirmed, publish them.

A ``Gateway`` turns measurements into sealed, numbered batches (seq strictly increasing per
gateway, no gaps, across restarts), keeps each one in a ``Spool`` until the pipeline
confirms it, and publishes it QoS 1 to ``ingest/<stream>/<gateway_id>``::

    from shoal.gateway import Gateway, GatewayConfig

    config = GatewayConfig("gw-7", stream="factory", spool_dir=Path("/var/lib/shoal/gw-7"))
    with Gateway(config) as gateway:
        gateway.add_many(sensor_ids, ts_ms, values)

Talks MQTT only through a ``shoal.broker.session.GatewaySession`` (``Gateway`` takes a
factory for it); never imports ``shoal.processors``.
"""

from shoal.gateway._gateway import Gateway
from shoal.gateway._stats import GatewayStats
from shoal.gateway.config import GatewayConfig
from shoal.gateway.spool import DiskSpool, MemorySpool, Spool, SpoolEntry

__all__ = [
    "DiskSpool",
    "Gateway",
    "GatewayConfig",
    "GatewayStats",
    "MemorySpool",
    "Spool",
    "SpoolEntry",
]
