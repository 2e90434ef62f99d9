"""The scaler: watches a pipeline's lag and keeps the right number of workers running.

Composition root. Every ``interval_s`` it reads the monitor (exact lag, arrival rate,
per-worker capacity and CPU), asks the policy, and tells the backend. It also serves the
figures over HTTP: Prometheus on ``/metrics`` and JSON for KEDA on ``/api/v1/scaling``, so
Kubernetes users can let KEDA act on ``desired_workers`` instead of the built-in backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.broker import default_session_factory
from shoal.broker.session import Message, SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.broker.sysmon import SYS_TOPICS, BrokerCounters
from shoal.clock import Clock, SystemClock
from shoal.control.follower import DocumentFollower, Dropped, Served
from shoal.errors import BrokerError, ShoalError
from shoal.processors.spec import PipelineSpec
from shoal.runtime._tasks import pause
from shoal.scaler.backends import Backend
from shoal.scaler.http import MetricsServer, prometheus_text
from shoal.scaler.monitor import PipelineMonitor, Snapshot
from shoal.scaler.policy import Bounds, Decision, Signals, make_policy
from shoal.scaler.signals import signals_from
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)


class PoolMonitor:
    """The worker pool seen from outside: a ``PipelineMonitor`` per deployed computation.

    The computations are followed from the retained pipeline documents.

    A pool worker does every pipeline's work for each batch it takes, so the pool's backlog is
    the **sum of the pipelines' lags** (each exact, design §4), its arrival rate the sum of
    theirs, and a worker's capacity (rows per CPU second over all its handlers) is measured
    on the same scale. Aliases compute nothing and are not counted.
    """

    def __init__(self, topics: Topics, clock: Clock) -> None:
        self.topics = topics
        self.clock = clock
        self.follower = DocumentFollower(topics)
        self.monitors: dict[str, PipelineMonitor] = {}
        self._status, self._confirms = topics.gateway_status_all(), topics.confirm_all()
        self._standing: dict[str, Message] = {}
        """The latest gateway status and confirmation on each topic: what a computation
        deployed later starts from (statuses come before the documents when the scaler
        subscribes, and a gateway may not speak again for a while)."""

    def filters(self) -> list[str]:
        """Gateways' status, confirmations, heartbeats and the pipeline documents."""
        t = self.topics
        return [t.gateway_status_all(), t.confirm_all(), t.metrics_all(), t.pipeline_documents()]

    def on_message(self, message: Message) -> None:
        """A document changes what is monitored; anything else goes to every monitor."""
        if self.follower.is_document(message.topic):
            change = self.follower.take(message)
            if isinstance(change, Served):
                current = self.monitors.get(change.name)
                if current is None or current.spec.partitions != change.spec.partitions:
                    monitor = PipelineMonitor(change.spec, self.topics, self.clock)
                    for standing in self._standing.values():
                        monitor.on_message(standing)
                    self.monitors[change.name] = monitor
                else:
                    current.spec = change.spec
            elif isinstance(change, Dropped):
                self.monitors.pop(change.name, None)
            return
        if topic_matches(self._status, message.topic) or topic_matches(
            self._confirms, message.topic
        ):
            self._standing[message.topic] = message
        for monitor in self.monitors.values():
            monitor.on_message(message)

    def snapshot(self) -> Snapshot:
        """The sum over the deployed computations (zero lag when none is deployed)."""
        snaps = [m.snapshot() for m in self.monitors.values()]
        workers: dict[str, dict[str, Any]] = {}
        for snap in snaps:
            workers.update(snap.worker_metrics)
        ages = [s.oldest_unconfirmed_age_ms for s in snaps if s.oldest_unconfirmed_age_ms]
        return Snapshot(
            at_ms=self.clock.now_ms(),
            rows_in_per_s=sum(s.rows_in_per_s for s in snaps),
            rows_out_per_s=sum(s.rows_out_per_s for s in snaps),
            workers=tuple(sorted(workers)),
            lag=tuple(g for s in snaps for g in s.lag),
            lag_batches=sum(s.lag_batches for s in snaps),
            lag_rows=sum(s.lag_rows for s in snaps),
            oldest_unconfirmed_age_ms=max(ages) if ages else None,
            rows_generated=sum(s.rows_generated for s in snaps),
            batch_rows_applied=sum(s.batch_rows_applied for s in snaps),
            windows_emitted=sum(s.windows_emitted for s in snaps),
            rows_in_results=sum(s.rows_in_results for s in snaps),
            deadletters=sum(s.deadletters for s in snaps),
            late_rows=sum(s.late_rows for s in snaps),
            window_memberships=sum(s.window_memberships for s in snaps),
            windows_per_row=1,
            latest=(),
            combiners={},
            worker_metrics=workers,
        )


@dataclass(frozen=True, slots=True)
class ScalerConfig:
    """How the scaler runs.

    Attributes:
        spec: the pipeline whose workers it scales (None: the worker pool, on the sum of the
            lags of every pipeline deployed at run time, ``PoolMonitor``).
        broker: where the broker is.
        topics: topic namespace.
        policy: ``lag`` (default), ``cpu`` or ``rps``.
        bounds: min and max workers.
        interval_s: seconds between decisions.
        http_port: port of the metrics endpoint (None: no endpoint; 0: any free port).
        http_host: address it listens on.
    """

    spec: PipelineSpec | None
    broker: BrokerSettings
    topics: Topics = field(default_factory=Topics)
    policy: str = "lag"
    bounds: Bounds = field(default_factory=Bounds)
    interval_s: float = 1.0
    http_port: int | None = 9464
    http_host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ScaleRecord:
    """One tick: what was measured and decided."""

    at_s: float
    signals: Signals
    decision: Decision


class Scaler:
    """Policy + backend + monitor (see the module docstring).

    ``tick`` is the whole decision step and can be driven by a host that already feeds a
    monitor (``shoal up``, the scaling benchmark); ``run`` does the feeding itself, through
    sessions from ``session_factory`` (default: ``default_session_factory()``).
    """

    def __init__(
        self,
        config: ScalerConfig,
        backend: Backend,
        *,
        clock: Clock | None = None,
        monitor: PipelineMonitor | PoolMonitor | None = None,
        on_decision: Callable[[ScaleRecord], None] | None = None,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.metrics: Callable[[], bytes | Awaitable[bytes]] = self.render_metrics
        """What ``/metrics`` serves (``shoal scaler`` sets ``shoal.observe``'s rendering of
        ``metric_samples``, with the process's own figures)."""
        self._connect = session_factory or default_session_factory()
        self.clock = clock or SystemClock()
        if monitor is None:
            monitor = (
                PoolMonitor(config.topics, self.clock)
                if config.spec is None
                else PipelineMonitor(config.spec, config.topics, self.clock)
            )
        self.monitor = monitor
        self.policy = make_policy(config.policy, config.bounds)
        self.broker_counters = BrokerCounters()
        self.history: list[ScaleRecord] = []
        self.scale_events = 0
        self._on_decision = on_decision
        self._stop = asyncio.Event()
        self.tick_errors = 0
        self.bound_port: int | None = None
        """The metrics endpoint's port once ``run`` serves it."""

    def tick(self) -> ScaleRecord:
        """Observe the backend, decide, apply."""
        record = self.decide(self.backend.observe())
        self.backend.scale_to(record.decision.desired)
        return record

    async def tick_async(self) -> ScaleRecord:
        """``tick`` with the backend's calls (a Kubernetes API round trip) off the event loop.

        Deciding stays on the loop, where the monitor is fed: no locking needed.
        """
        workers = await asyncio.to_thread(self.backend.observe)
        record = self.decide(workers)
        await asyncio.to_thread(self.backend.scale_to, record.decision.desired)
        return record

    def decide(self, workers: int) -> ScaleRecord:
        """What the policy wants, given ``workers`` live workers (recorded, not applied)."""
        now = self.clock.monotonic()
        signals = signals_from(self.monitor.snapshot(), now, workers)
        decision = self.policy.decide(signals)
        if decision.desired != workers:
            self.scale_events += 1
            log.info(
                "scaler: %d -> %d workers (%s; %.0f meas/s, lag %d meas)",
                workers,
                decision.desired,
                decision.reason,
                signals.arrival_rows_per_s,
                signals.backlog_rows,
            )
        record = ScaleRecord(now, signals, decision)
        self.history.append(record)
        del self.history[:-3600]
        if self._on_decision is not None:
            self._on_decision(record)
        return record

    def stop(self) -> None:
        """Finish the run loop."""
        self._stop.set()

    async def run(self) -> None:
        """Feed the monitor from the broker, decide every interval, serve metrics."""
        server = None
        if self.config.http_port is not None:
            server = MetricsServer(
                self.metrics, self.render_json, self.config.http_host, self.config.http_port
            )
            self.bound_port = port = await server.start()
            log.info("scaler: metrics on http://%s:%d/metrics", self.config.http_host, port)
        try:
            while not self._stop.is_set():
                try:
                    await self._session()
                except BrokerError as exc:
                    log.warning("scaler: %s; reconnecting", exc)
                    await pause(1.0, self._stop)
        finally:
            if server is not None:
                await server.close()
            self.backend.close()

    async def _session(self) -> None:
        session = self._connect(self.config.broker, unique_client_id("shoal-scaler"))
        async with session:
            await session.subscribe([*self.monitor.filters(), *SYS_TOPICS], qos=0)
            ticker = asyncio.create_task(self._ticks())
            try:
                async for message in session.messages_until(self._stop):
                    if not self.broker_counters.take(message.topic, message.payload):
                        self.monitor.on_message(message)
            finally:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)

    async def _ticks(self) -> None:
        while True:
            started = self.clock.monotonic()
            try:
                await self.tick_async()
            except ShoalError as exc:
                # The backend failed (API down, RBAC): keep the scaler alive, try again.
                self.tick_errors += 1
                log.warning("scaler: could not observe or scale the workers: %s", exc)
            await asyncio.sleep(
                max(0.0, self.config.interval_s - (self.clock.monotonic() - started))
            )

    # -- what the endpoint serves --------------------------------------------------------------

    @property
    def _label(self) -> str:
        """The ``pipeline`` label of its figures (``*``: the pool, every deployed pipeline)."""
        return "*" if self.config.spec is None else self.config.spec.name

    def render_json(self) -> dict[str, Any]:
        """The JSON KEDA's ``metrics-api`` scaler reads."""
        last = self.history[-1] if self.history else None
        snap = self.monitor.snapshot()
        return {
            "pipeline": self._label,
            "policy": self.policy.name,
            "desired_workers": None if last is None else last.decision.desired,
            "workers": None if last is None else last.signals.workers,
            "lag_batches": snap.lag_batches,
            "lag_measurements": snap.lag_rows,
            "lag_seconds": None
            if snap.oldest_unconfirmed_age_ms is None
            else snap.oldest_unconfirmed_age_ms / 1000.0,
            "arrival_measurements_per_s": snap.rows_in_per_s,
            "capacity_measurements_per_s": None
            if last is None
            else last.signals.capacity_rows_per_s,
            "scale_events": self.scale_events,
            "broker": self.broker_counters.values,
        }

    def render_metrics(self) -> bytes:
        """Prometheus text exposition of the lag, rates, workers and broker counters."""
        return prometheus_text(self.metric_samples())

    def metric_samples(self) -> list[tuple[str, str, str, dict[str, str], float | int | None]]:
        """``(name, type, help, labels, value)`` of every figure ``/metrics`` shows."""
        data = self.render_json()
        pipeline = {"pipeline": self._label}
        snap = self.monitor.snapshot()
        samples: list[tuple[str, str, str, dict[str, str], float | int | None]] = [
            (
                "shoal_lag_batches",
                "gauge",
                "Batches published but not confirmed.",
                pipeline,
                data["lag_batches"],
            ),
            (
                "shoal_lag_measurements",
                "gauge",
                "Measurements published but not confirmed.",
                pipeline,
                data["lag_measurements"],
            ),
            (
                "shoal_lag_oldest_seconds",
                "gauge",
                "Age of the oldest unconfirmed batch.",
                pipeline,
                data["lag_seconds"],
            ),
            (
                "shoal_arrival_measurements_per_second",
                "gauge",
                "Measurements per second published by gateways.",
                pipeline,
                data["arrival_measurements_per_s"],
            ),
            ("shoal_workers", "gauge", "Live workers.", pipeline, data["workers"]),
            (
                "shoal_workers_desired",
                "gauge",
                "Workers the policy wants.",
                pipeline,
                data["desired_workers"],
            ),
            (
                "shoal_worker_capacity_measurements_per_second",
                "gauge",
                "Measured measurements per busy second of one worker (median).",
                pipeline,
                data["capacity_measurements_per_s"],
            ),
            (
                "shoal_scale_events_total",
                "counter",
                "Changes of the worker count.",
                pipeline,
                self.scale_events,
            ),
            (
                "shoal_measurements_generated_total",
                "counter",
                "Measurements sealed by gateways.",
                pipeline,
                snap.rows_generated,
            ),
            (
                "shoal_measurements_applied_total",
                "counter",
                "Measurements of applied batches.",
                pipeline,
                snap.batch_rows_applied,
            ),
            (
                "shoal_late_measurements_total",
                "counter",
                "Measurements reported late.",
                pipeline,
                snap.late_rows,
            ),
            (
                "shoal_deadletters_total",
                "counter",
                "Dead-lettered messages.",
                pipeline,
                snap.deadletters,
            ),
            (
                "shoal_windows_emitted_total",
                "counter",
                "Window result messages.",
                pipeline,
                snap.windows_emitted,
            ),
        ]
        samples.extend(
            (
                "shoal_gateway_lag_batches",
                "gauge",
                "Unconfirmed batches per gateway.",
                {**pipeline, "gateway": g.gateway_id},
                g.batches,
            )
            for g in snap.lag
        )
        samples.extend(
            (f"shoal_broker_{name}", "gauge", f"Mosquitto $SYS counter ({name}).", {}, value)
            for name, value in self.broker_counters.values.items()
        )
        return samples
