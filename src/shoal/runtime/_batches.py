"""One pipeline's batch handling in a worker: decode → row rules → partials → publish them.

Shared by the pinned worker (one pipeline) and the pool worker (every deployed pipeline):
``BatchHandler.handle`` is steps 1-3 of the ack order written down in
``shoal.runtime.worker``; the worker's acker waits for the PUBACK futures it returns and
only then acknowledges the input (step 4). A handler holds no task, thread or connection,
so a pool worker serving many pipelines holds many small handlers over one session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from shoal.broker.session import Message, Session
from shoal.clock import Clock
from shoal.errors import FunctionError, InputError
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.rules.guard import FunctionGuard
from shoal.runtime._shared_work import SharedWork
from shoal.runtime.latency import LatencyHistogram
from shoal.schemas import Batch, decode_batch, peek_envelope
from shoal.schemas.deadletter import DEADLETTER_HEADROOM, deadletter_message
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)


@dataclass
class WorkerCounters:
    """What one worker has done since it started (over every pipeline it serves)."""

    batches: int = 0
    rows: int = 0
    rows_clamped: int = 0
    """Rows whose timestamps lay beyond ``max_future_ms`` and were clamped (``on_future``)."""
    deadletters: int = 0
    partials: int = 0
    rows_filtered: int = 0
    """Rows the row stage removed: ``where`` false or null, or a derived value not finite."""
    busy_s: float = 0.0
    reconnects: int = 0
    unrouted: int = 0
    """Deliveries no served pipeline claimed (acknowledged and logged; should stay 0)."""


@dataclass
class WorkerStats:
    """Counters and recent timings one worker's handlers add to (its heartbeat reads them)."""

    counters: WorkerCounters = field(default_factory=WorkerCounters)
    handle_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    publish_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    """Per batch with a send time: the gateway sealed it (``sent_at_ms``, its clock) →
    its partials handed to the broker here (this clock): the heartbeat's
    ``publish_to_partial_ms``, the equivalent of a request/reply system's round trip."""
    recent: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=64))
    """(when, rows, CPU seconds) of recent batches: the capacity estimate."""
    deadletter_reasons: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Dead letters by (pipeline, reason) (``counters.deadletters`` is their sum)."""
    functions: dict[str, FunctionGuard] = field(default_factory=dict)
    """Per pipeline with user functions, its guard (the heartbeat's ``functions``)."""

    def functions_health(self) -> dict[str, dict[str, object]]:
        """The heartbeat's ``functions``: per pipeline, what its functions did here."""
        return {
            name: guard.health.as_dict(guard.degrade_after)
            for name, guard in sorted(self.functions.items())
        }


class BatchHandler:
    """Turns one pipeline's input messages into published partials (or a dead letter).

    Args:
        spec: the pipeline (one version of it).
        topics: topic namespace.
        worker_id: stamped on partials and dead letters.
        stats: where counters and timings go (shared by a worker's handlers).
        clock: the worker's clock.
        shared: the decodes and partials a pool worker's handlers share for copies of one
            batch (``shoal.runtime._shared_work``); None: this handler's own.
    """

    def __init__(  # noqa: PLR0917 - the worker's parts, passed on
        self,
        spec: PipelineSpec,
        topics: Topics,
        worker_id: str,
        stats: WorkerStats,
        clock: Clock,
        shared: SharedWork | None = None,
    ) -> None:
        self.spec = spec
        self.topics = topics
        self.worker_id = worker_id
        self.stats = stats
        self.clock = clock
        self.builder = PartialBuilder(spec, worker_id)
        self.shared = shared
        self.filters = tuple(topics.shared(spec.name, topics.under_root(f)) for f in spec.inputs)
        """The pipeline's shared subscriptions: ``$share/<pipeline>/<input>``."""
        self.guard: FunctionGuard | None = None
        """Runs the batch work of a pipeline with user functions (``shoal.rules.guard``)."""
        if spec.calls_functions:
            self.guard = FunctionGuard(
                spec.loaded.budget_ms / 1000.0, spec.degrade_after, clock.monotonic
            )
            stats.functions[spec.name] = self.guard
        self._inputs = tuple(topics.under_root(f) for f in spec.inputs)

    def reads(self, topic: str) -> bool:
        """Whether ``topic`` is one of this spec's inputs."""
        return any(topic_matches(f, topic) for f in self._inputs)

    def handle(self, session: Session, message: Message) -> list[asyncio.Future[None]]:
        """Decode, compute, start publishing; returns the PUBACK futures to wait for.

        A pipeline with user functions computes in its guard's thread, under its budget:
        the one future returned then completes once the partials (or the dead letter) are
        published, and the worker's loop goes on reading meanwhile.
        """
        started = self.clock.monotonic()
        cpu_started = time.process_time()
        now = self.clock.now_ms()
        futures: list[asyncio.Future[None]] = []
        partials: list[Partial]
        try:
            batch, info, now = self._decoded(message, now)
            if self.guard is not None:
                work = self._guarded(session, message, batch, info, now, (started, cpu_started))
                return [asyncio.ensure_future(work)]
            # The row stage (where/derive) runs inside the builder, on the decoded frame.
            partials = self._built(batch, info, now)
            self._count(batch, partials)
        except InputError as exc:
            partials = self._refuse(session, message, exc, now=now, futures=futures)
        self._publish(session, partials, futures, (started, cpu_started))
        return futures

    async def _guarded(  # noqa: PLR0917 - private; handle's state, passed on
        self,
        session: Session,
        message: Message,
        batch: Batch,
        info: BatchInfo,
        now: int,
        began: tuple[float, float],
    ) -> None:
        """``handle`` for a pipeline with functions: compute under the guard, publish, wait.

        A function's failure dead-letters the batch (raw payload and reason) and marks it
        handled with empty rejected partials, as a refused batch is.
        """
        assert self.guard is not None
        futures: list[asyncio.Future[None]] = []
        try:
            partials = await self.guard.run(lambda: self.builder.build_batch(batch, info, now))
            self._count(batch, partials)
        except FunctionError as exc:
            partials = self._refuse(session, message, exc, now=now, futures=futures)
        self._publish(session, partials, futures, began)
        await session.wait_published(futures)

    def _count(self, batch: Batch, partials: list[Partial]) -> None:
        counters = self.stats.counters
        counters.rows_filtered += partials[0].batch.filtered if partials else 0
        counters.batches += 1
        counters.rows += batch.rows
        counters.rows_clamped += batch.clamped

    def _publish(
        self,
        session: Session,
        partials: list[Partial],
        futures: list[asyncio.Future[None]],
        began: tuple[float, float],
    ) -> None:
        """Start publishing ``partials`` (their futures join ``futures``); record timings."""
        counters = self.stats.counters
        started, cpu_started = began
        futures.extend(
            session.publish_started(
                self.topics.partials(self.spec.name, partial.partition), partial.encode()
            )
            for partial in partials
        )
        counters.partials += len(partials)
        elapsed = self.clock.monotonic() - started
        counters.busy_s += elapsed
        rows = partials[0].batch.rows if partials else 0
        # Capacity counts CPU time, not wall time: on a crowded machine a worker waits for a
        # core, and that says nothing about what one more worker with its own core would do.
        self.stats.recent.append((self.clock.monotonic(), rows, time.process_time() - cpu_started))
        self.stats.handle_latency.add(elapsed * 1000.0)
        sent_at_ms = partials[0].batch.sent_at_ms if partials else 0
        if sent_at_ms > 0:
            self.stats.publish_latency.add(float(self.clock.now_ms() - sent_at_ms))

    def _decoded(self, message: Message, now: int) -> tuple[Batch, BatchInfo, int]:
        """``_decode``, or the decode another pipeline's copy of the batch made (and its time)."""
        if self.shared is None:
            return *self._decode(message, now), now
        return self.shared.decode(
            message, self.spec.limits, now, lambda: self._decode(message, now)
        )

    def _built(self, batch: Batch, info: BatchInfo, now: int) -> list[Partial]:
        """The partials, or those another pipeline with the same fingerprint made (renamed)."""
        if self.shared is None:
            return self.builder.build_batch(batch, info, now)
        return self.shared.partials(
            batch,
            self.builder.fingerprint,
            self.spec.name,
            lambda: self.builder.build_batch(batch, info, now),
        )

    def _decode(self, message: Message, now: int) -> tuple[Batch, BatchInfo]:
        """The batch's frame and identity, or an ``InputError`` saying why not."""
        route = self.topics.ingest_gateway(message.topic)
        if route is None:
            raise InputError(
                f"message on {message.topic!r}, which is not an ingest topic", reason="bad_topic"
            )
        stream, gateway_id = route
        batch = decode_batch(
            message.payload,
            content_type=message.content_type,
            limits=self.spec.limits,
            now_ms=now,
            payload_format=message.payload_format,
        )
        if batch.envelope.gateway_id != gateway_id:
            raise InputError(
                "the batch names another gateway than its topic",
                reason="gateway_mismatch",
                field="gateway_id",
                expected=gateway_id,
                found=batch.envelope.gateway_id,
            )
        info = BatchInfo(
            gateway_id=gateway_id,
            seq=batch.envelope.seq,
            stream=stream,
            rows=batch.rows,
            min_ts=None,
            max_ts=None,
            sent_at_ms=batch.envelope.sent_at_ms,
            received_at_ms=now,
            worker=self.worker_id,
        )
        return batch, info

    def _refuse(
        self,
        session: Session,
        message: Message,
        exc: InputError,
        *,
        now: int,
        futures: list[asyncio.Future[None]],
    ) -> list[Partial]:
        """Dead-letter a refused message; mark its batch handled if we can name it."""
        self.stats.counters.deadletters += 1
        spec = self.spec
        self.stats.deadletter_reasons[spec.name, exc.reason] += 1
        log.info("worker %s: dead-lettering %s: %s", self.worker_id, message.topic, exc)
        record = deadletter_message(
            pipeline=spec.name,
            topic=message.topic,
            content_type=message.content_type,
            payload=message.payload,
            error=exc.as_record(),
            worker=self.worker_id,
            at_ms=now,
            max_bytes=None
            if session.max_packet_size is None
            else session.max_packet_size - DEADLETTER_HEADROOM,
        )
        futures.append(
            session.publish_started(
                self.topics.deadletter(spec.name),
                record,
                user_properties=[("reason", exc.reason), ("code", exc.code)],
            )
        )
        route = self.topics.ingest_gateway(message.topic)
        if route is None or exc.reason == "gateway_mismatch":
            return []  # no trustworthy (gateway, seq): nothing to mark as handled
        named = peek_envelope(message.payload, spec.limits)
        if named is None or named[0] != route[1]:
            return []
        info = BatchInfo(
            gateway_id=named[0],
            seq=named[1],
            stream=route[0],
            rows=0,
            min_ts=None,
            max_ts=None,
            sent_at_ms=0,
            received_at_ms=now,
            worker=self.worker_id,
            status="rejected",
            reason=exc.reason,
        )
        return self.builder.rejected(info, now)
