"""Prometheus metrics of every long-running process, read from the counters it already keeps.

``MetricsEndpoint`` serves ``GET /metrics`` (``--metrics-port``/``--metrics-host`` on each
command) over collectors that read, at scrape time, the objects a process's heartbeat reads
(``shoal.observe.collectors``). Only the CLI imports this package; it imports the processes it
observes, never the reverse, and nothing here speaks MQTT. Metric list: docs/metrics.md.
"""

from __future__ import annotations

from prometheus_client.registry import Collector

from shoal.observe._exposition import (
    DEFAULT_HOST,
    LATENCY_BUCKETS_S,
    Families,
    MetricsEndpoint,
    registry_of,
    render_async,
)

__all__ = [
    "DEFAULT_HOST",
    "LATENCY_BUCKETS_S",
    "Collector",
    "Families",
    "MetricsEndpoint",
    "registry_of",
    "render_async",
]
