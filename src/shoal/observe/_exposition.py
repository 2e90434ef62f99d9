"""Metric families built at scrape time, and the ``/metrics`` endpoint that serves them.

Collectors (``shoal.observe.collectors``) read the counters a process already keeps for its
heartbeat and turn them into Prometheus families here, once per scrape: nothing is counted
twice and the hot path does not change. The endpoint (the scaler's tiny asyncio server)
collects on the event loop, so a scrape sees counters between two steps of the process, never
halfway through one, and formats the text in a thread: for a pool combiner with hundreds of
partitions the formatting is the larger part, and the loop keeps handling batches meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Final, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shoal.runtime.latency import LatencyHistogram
from shoal.scaler.http import MetricsServer

log = logging.getLogger(__name__)
_F = TypeVar("_F", CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)

LATENCY_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""``le`` bounds of every latency histogram (seconds): a batch's handling to a window's wait."""
_BOUNDS_MS: Final = tuple(b * 1000.0 for b in LATENCY_BUCKETS_S)
DEFAULT_HOST: Final = "127.0.0.1"
"""Where ``--metrics-host`` listens unless told otherwise (scrapers on the same host)."""


class Families:
    """The metric families of one scrape, filled sample by sample.

    A family is created on its first sample; its label names are those of that sample, so a
    family must always be given the same label keys.
    """

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def counter(self, name: str, doc: str, labels: Mapping[str, str], value: float | None) -> None:
        """A sample of a counter (``name`` ends in ``_total``).

        None: only declare the family, so a labelled counter without samples is still listed.
        """
        family = self._family(CounterMetricFamily, name, doc, labels)
        if value is not None:
            family.add_metric(list(labels.values()), value)

    def counter_by(
        self,
        name: str,
        doc: str,
        labels: Mapping[str, str],
        by: str,
        values: Mapping[str, float],
    ) -> None:
        """A counter per value of the label ``by`` (declared even without samples yet)."""
        self.counter(name, doc, {**labels, by: ""}, None)
        for value, n in sorted(values.items()):
            self.counter(name, doc, {**labels, by: value}, n)

    def gauge(self, name: str, doc: str, labels: Mapping[str, str], value: float | None) -> None:
        """A sample of a gauge (None: no sample, e.g. no watermark yet)."""
        family = self._family(GaugeMetricFamily, name, doc, labels)
        if value is not None:
            family.add_metric(list(labels.values()), value)

    def histogram(
        self, name: str, doc: str, labels: Mapping[str, str], latency: LatencyHistogram
    ) -> None:
        """A latency histogram in seconds, from a process's millisecond ``LatencyHistogram``."""
        family = self._family(HistogramMetricFamily, name, doc, labels)
        counts = latency.cumulative(_BOUNDS_MS)
        buckets: list[tuple[str, float]] = [
            (_le(bound), float(n)) for bound, n in zip(LATENCY_BUCKETS_S, counts, strict=True)
        ]
        buckets.append(("+Inf", float(latency.count)))
        family.add_metric(list(labels.values()), buckets, latency.total_ms / 1000.0)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())

    def _family(self, kind: type[_F], name: str, doc: str, labels: Mapping[str, str]) -> _F:
        """The family ``name``, created on its first sample with that sample's label names."""
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = kind(name, doc, labels=list(labels))
        assert isinstance(family, kind), f"{name} is not a {kind.__name__}"
        return family


def _le(bound: float) -> str:
    return repr(bound)


class _Collected(Collector):
    """Families already read (``MetricsEndpoint.render_async``)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        """The families as they were read."""
        return iter(self.families)


def _text(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected(families))
    return generate_latest(registry)


async def render_async(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry``: read on the event loop, formatted in a thread."""
    families = list(registry.collect())
    return await asyncio.to_thread(_text, families)


def registry_of(collectors: Sequence[Collector], *, process: bool = True) -> CollectorRegistry:
    """A registry with ``collectors`` (and the process's CPU, memory and file descriptors)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    if process:
        ProcessCollector(registry=registry)
    return registry


class MetricsEndpoint:
    """``GET /metrics`` over ``collectors``, on ``host:port`` (0: any free port).

    ``start`` returns the port it listens on; ``close`` stops listening.
    """

    def __init__(
        self, collectors: Sequence[Collector], *, host: str = DEFAULT_HOST, port: int = 0
    ) -> None:
        self.registry = registry_of(collectors)
        self.host = host
        self._server = MetricsServer(
            self.render_async, None, host=host, port=port, content_type=CONTENT_TYPE_LATEST
        )

    def render(self) -> bytes:
        """The text exposition of every collector, now."""
        return generate_latest(self.registry)

    async def render_async(self) -> bytes:
        """``render``, with only the reading on the event loop and the formatting in a thread."""
        return await render_async(self.registry)

    async def start(self) -> int:
        """Listen; logs and returns the port."""
        port = await self._server.start()
        log.info("metrics on http://%s:%d/metrics", self.host, port)
        return port

    async def close(self) -> None:
        """Stop listening."""
        await self._server.close()
