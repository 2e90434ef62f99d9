"""The worker: a member of pipelines' shared subscriptions that turns batches into partials.

Composition root (imported by the CLI and tests only). A worker serves one pipeline
(``WorkerConfig.spec``: ``shoal worker --pipeline FILE``) or, in the pool, every deployed
one (``spec`` None: ``shoal.runtime.pool``); the difference is its ``Routes``. Per batch,
``BatchHandler.handle`` (``runtime/_batches.py``) does steps 1-3 and ``Worker._ack_in_order``
step 4; this order is the delivery guarantee:

1. decode the batch strictly (a refused batch becomes a dead letter: raw payload + reason);
2. compute the partials for every combiner partition in one vectorised pass (a refused batch
   whose gateway and seq are readable gets empty "rejected" partials, so it still counts as
   handled for its gateway's sequence);
3. publish the partials and the dead letter, and wait for the broker's PUBACKs;
4. only then PUBACK the input.

A crash anywhere before step 4 leaves the batch unacknowledged: the broker or, failing that,
the gateway's spool delivers it again, and the combiners drop whatever was already applied.
Up to ``receive_maximum`` batches are in flight; acknowledgements leave in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Final

import orjson
import psutil

from shoal.broker import default_worker_session_factory
from shoal.broker.session import Message, Session, SessionFactory, Will, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SystemClock
from shoal.control.messages import Marker
from shoal.errors import BrokerError
from shoal.processors.spec import PipelineSpec
from shoal.runtime._batches import BatchHandler, WorkerCounters, WorkerStats
from shoal.runtime._heartbeat import heartbeat_payload
from shoal.runtime._routes import PinnedRoutes, Routes
from shoal.runtime._tasks import pause, supervised
from shoal.runtime.latency import LatencyHistogram
from shoal.runtime.pool import PoolRoutes
from shoal.schemas.topics import Topics

__all__ = ["Worker", "WorkerConfig", "WorkerCounters"]

log = logging.getLogger(__name__)

_OUTPUT_SUFFIX: Final = "-out"
"""The client id of a worker's output session: its own id with this suffix."""
WORKER_READ_BYTES: Final = 64 * 1024
"""What one read of the batches' socket takes at most: a 16,000-row batch (187 KB) in three
reads, not 46 of the 4 KiB a session bounded in messages reads by default (each a turn of
the event loop); at most this much is read past the receive maximum."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How one worker runs.

    Attributes:
        spec: the pipeline; None: join the pool and serve every deployed pipeline.
        broker: where the broker is.
        topics: topic namespace.
        worker_id: unique per live worker (also its MQTT client id); generated if empty.
        receive_maximum: batches in flight to this worker (MQTT 5 Receive Maximum). The
            worker holds to it itself, as Mosquitto 2.0.11 sends past it once we
            acknowledge: at most that many handled and not acknowledged (``_Window``), and
            its session reads no more while that many wait to be handled
            (``max_buffered_messages``).
        heartbeat_ms: how often metrics are published.
        reconnect_delay_s: pause before reconnecting after a lost connection.
    """

    spec: PipelineSpec | None
    broker: BrokerSettings
    topics: Topics = field(default_factory=Topics)
    worker_id: str = ""
    receive_maximum: int = 8
    heartbeat_ms: int = 1_000
    reconnect_delay_s: float = 0.5


class Worker:
    """One worker process's logic (see the module docstring for the ack order).

    ``session_factory`` opens its MQTT sessions (default: ``default_worker_session_factory()``):
    one for its input (subscriptions, deliveries, acknowledgements, its control topic, its
    will) and one it publishes on (partials, dead letters, heartbeats), as a combiner does:
    while the input's socket is not read (a full ``_Window``), the PUBACKs the oldest batch
    waits for still arrive.
    """

    def __init__(
        self,
        config: WorkerConfig,
        clock: Clock | None = None,
        *,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self._connect = session_factory or default_worker_session_factory()
        spec = config.spec
        prefix = "shoal-worker-pool" if spec is None else f"shoal-worker-{spec.name}"
        self.worker_id = config.worker_id or unique_client_id(prefix)
        self.stats = WorkerStats()
        self.counters = self.stats.counters
        self.started_at = self.clock.monotonic()
        self._control_topic = config.topics.control(self.worker_id)
        self._beat_now = asyncio.Event()
        self.routes: Routes = (
            PoolRoutes(
                config.topics,
                self.worker_id,
                self.stats,
                self.clock,
                self._control_topic,
                on_change=self._beat_now.set,
            )
            if spec is None
            else PinnedRoutes(
                BatchHandler(spec, config.topics, self.worker_id, self.stats, self.clock)
            )
        )
        self._stop = asyncio.Event()
        self._finished = asyncio.Event()
        self._drain_requested = asyncio.Event()
        self._leaving = asyncio.Event()  # stop or drain: a reconnect delay ends at once
        self._drained = asyncio.Event()
        self._state = "running"
        self._marker_token = os.urandom(8).hex()
        self._process = psutil.Process()
        # (when, CPU seconds, batches, rows) at the last heartbeat; the first one measures
        # from here, not from the start of the process (imports are not work).
        cpu = self._process.cpu_times()
        self._last_beat = (self.started_at, cpu.user + cpu.system, 0, 0)

    def stop(self) -> None:
        """Stop at once: acknowledge what is in hand and disconnect.

        Batches the broker had queued for this worker are lost to it and come back through
        the gateways' spools; ``drain`` is the lossless way to leave.
        """
        self._stop.set()
        self._finished.set()
        self._leaving.set()

    async def run(self) -> None:
        """Connect, subscribe, process until ``stop``; reconnect after broker failures.

        Asked to leave (``stop``, ``drain``) while the broker is unreachable, it returns at
        once: its session (expiry 0) went with the connection, so nothing waits in the
        broker for it, and the batches it had not acknowledged come back from the gateways'
        spools (their combiners never confirmed them).
        """
        topics = self.config.topics
        while not self._leaving.is_set():
            session = self._connect(
                self.config.broker,
                self.worker_id,
                clean_start=True,
                session_expiry_s=0,
                receive_maximum=self.config.receive_maximum,
                manual_ack=True,
                max_buffered_messages=self.config.receive_maximum,
                read_bytes=WORKER_READ_BYTES,
                will=Will(
                    topics.metrics("worker", self.worker_id),
                    orjson.dumps({"component": "worker", "id": self.worker_id, "state": "gone"}),
                ),
            )
            out = self._connect(self.config.broker, f"{self.worker_id}{_OUTPUT_SUFFIX}")
            try:
                async with session, out:
                    # Mosquitto does not restore $share subscriptions: subscribe on every connect.
                    await session.subscribe([topics.control(self.worker_id)], qos=1)
                    await self.routes.join(session)
                    await self._serve(session, out)
                if self._drained.is_set():
                    break
            except BrokerError as exc:
                if self._leaving.is_set():
                    break
                self.counters.reconnects += 1
                log.warning("worker %s: %s; reconnecting", self.worker_id, exc)
                await pause(self.config.reconnect_delay_s, self._leaving)
        if self._drain_requested.is_set() and not self._drained.is_set():
            log.warning(
                "worker %s: left without draining, not being connected to the broker: the "
                "batches it had not acknowledged come back from the gateways' spools",
                self.worker_id,
            )

    async def _serve(self, session: Session, out: Session) -> None:
        inflight: asyncio.Queue[tuple[Message, list[asyncio.Future[None]]] | None] = asyncio.Queue()
        window = _Window(self.config.receive_maximum)
        done = asyncio.Event()
        async with supervised(
            self._finished,
            self._ack_in_order(session, out, inflight, window, done),
            self._heartbeat(out),
            self._drain_when_asked(session, out),
        ) as ending:
            async for message in session.messages_until(ending):
                await window.enter()
                if message.topic == self._control_topic:
                    self._on_control(message)
                    await inflight.put((message, []))  # control messages are acked in order too
                    continue
                await inflight.put((message, await self.routes.route(session, message, out)))
            # Acknowledge what we hold before leaving (the acker sets `done` even if it fails).
            await inflight.put(None)
            await done.wait()

    # -- draining ---------------------------------------------------------------------------

    def drain(self) -> None:
        """Leave the group without losing anything (see ``_drain_when_asked``).

        Without a connection there is nothing to drain: ``run`` returns.
        """
        self._drain_requested.set()
        self._leaving.set()

    async def _drain_when_asked(self, session: Session, out: Session) -> None:
        """Scale-down without loss: stop new routing, flush the queue, then leave.

        1. UNSUBSCRIBE from the shared filters (every pipeline's, in the pool): the broker
           routes no new batches to us;
        2. publish a marker to our own control topic: it is queued behind every batch the
           broker had already queued for us (UNSUBSCRIBE does not flush that queue);
        3. keep processing until the marker comes back, then acknowledge what we hold
           and DISCONNECT (session expiry 0, so nothing stays behind in the broker).
        """
        await self._drain_requested.wait()
        self._state = "draining"
        log.info("worker %s: draining", self.worker_id)
        await self.routes.leave(session)
        marker = Marker.on(self._control_topic, self._marker_token)
        await out.publish(marker.topic, marker.payload)
        await self._drained.wait()
        self._finished.set()

    def _on_control(self, message: Message) -> None:
        try:
            body = orjson.loads(message.payload)
        except orjson.JSONDecodeError:
            log.warning("worker %s: unreadable control message", self.worker_id)
            return
        command = body.get("cmd") if isinstance(body, dict) else None
        if command == "drain":
            self.drain()
        elif command == "reset_stats":  # benchmarks measure steady state, not the warm-up
            self.stats.handle_latency = LatencyHistogram()
            self.stats.publish_latency = LatencyHistogram()
        elif command == "marker" and body.get("token") == self._marker_token:
            log.info("worker %s: drained", self.worker_id)
            self._drained.set()
        elif command == "marker" and self.routes.marker_back(str(body.get("token"))):
            return
        else:
            log.warning("worker %s: unknown control message %r", self.worker_id, body)

    async def _ack_in_order(
        self,
        session: Session,
        out: Session,
        inflight: asyncio.Queue[tuple[Message, list[asyncio.Future[None]]] | None],
        window: _Window,
        done: asyncio.Event,
    ) -> None:
        # MQTT wants PUBACKs in arrival order; each waits for its outputs' PUBACKs first.
        try:
            while (item := await inflight.get()) is not None:
                message, futures = item
                await out.wait_published(futures)
                session.ack(message)
                window.leave()
        finally:
            window.close()  # a failed acker: the loop must not wait for room (it ends)
            done.set()

    def capacity_rows_per_s(self) -> float | None:
        """Rows this worker processes per CPU second of handling (recent batches)."""
        recent = self.stats.recent
        busy = sum(e for _, _, e in recent)
        rows = sum(r for _, r, _ in recent)
        return rows / busy if busy > 0 and rows else None

    def metrics(self) -> dict[str, object]:
        """The heartbeat payload (rates and fractions over the last heartbeat interval)."""
        now = self.clock.monotonic()
        uptime = now - self.started_at
        cpu = self._process.cpu_times()
        cpu_s = cpu.user + cpu.system
        last = self._last_beat
        self._last_beat = (now, cpu_s, self.counters.batches, self.counters.rows)
        window = max(now - last[0], 1e-6)
        return {
            "component": "worker",
            "id": self.worker_id,
            **self.routes.describe(),
            "state": "stopping" if self._stop.is_set() else self._state,
            "at": self.clock.now_ms(),
            "uptime_s": round(uptime, 3),
            "batches": self.counters.batches,
            "rows": self.counters.rows,
            "rows_clamped": self.counters.rows_clamped,
            "rows_filtered": self.counters.rows_filtered,
            "deadletters": self.counters.deadletters,
            "partials": self.counters.partials,
            "busy_s": round(self.counters.busy_s, 6),
            "busy_fraction": round(self.counters.busy_s / uptime, 4) if uptime > 0 else 0.0,
            "cpu_percent": round(100.0 * (cpu_s - last[1]) / window, 1),
            "batches_per_s": round((self.counters.batches - last[2]) / window, 3),
            "rows_per_s": round((self.counters.rows - last[3]) / window, 1),
            "capacity_rows_per_s": self.capacity_rows_per_s(),
            "handle_ms": self.stats.handle_latency.summary(),
            "publish_to_partial_ms": self.stats.publish_latency.summary(),
            "reconnects": self.counters.reconnects,
            "unrouted": self.counters.unrouted,
            **({"functions": functions} if (functions := self.stats.functions_health()) else {}),
        }

    async def _heartbeat(self, session: Session) -> None:
        topic = self.config.topics.metrics("worker", self.worker_id)
        while True:
            try:
                await session.publish(topic, heartbeat_payload(self.metrics()), qos=0)
            except BrokerError:
                return
            self._beat_now.clear()
            # Next beat after heartbeat_ms, or at once when what the worker serves changed
            # (`shoal pipeline deploy` waits for that beat). asyncio.timeout, never wait_for:
            # Python 3.11's wait_for drops a cancellation that lands as the event is set
            # (CPython gh-86296), and this loop then outlives its session: a stopped worker hung.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_ms / 1000):
                    await self._beat_now.wait()


class _Window:
    """Batches handled and not yet acknowledged: at most ``size`` (the receive maximum).

    The broker should hold the rest, and does once it honours our Receive Maximum;
    Mosquitto 2.0.11 does not once we acknowledge (docs/guarantees.md, "Overload"), and
    without this bound a worker whose PUBACKs were slow took batch after batch, each
    handled and its partials queued for a broker already behind (chaos overload: 90
    batches and 164 partials held, RSS 76 -> 136 MB). At the bound the loop takes no more,
    so the session's read gate closes and TCP holds the broker back.
    """

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.held = 0
        self._room = asyncio.Event()
        self._closed = False

    async def enter(self) -> None:
        """Wait until fewer than ``size`` are held (or the acker is gone), then hold one."""
        while self.held >= self.size and not self._closed:
            self._room.clear()
            await self._room.wait()
        self.held += 1

    def leave(self) -> None:
        """One was acknowledged."""
        self.held -= 1
        self._room.set()

    def close(self) -> None:
        """Nothing will be acknowledged any more: never wait again."""
        self._closed = True
        self._room.set()
