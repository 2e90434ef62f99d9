"""A live pipeline for tests: in-process workers and combiners on a broker.

The broker is Mosquitto (``AsyncSession``, the default) or, given ``MemoryBroker.session_factory``,
the in-memory one. On Mosquitto, workers read and publish on the session they use in
production (``default_worker_session_factory``) and combiners publish on theirs
(``default_output_session_factory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from shoal.broker import (
    AsyncSession,
    default_output_session_factory,
    default_worker_session_factory,
)
from shoal.broker.session import Message, SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError
from shoal.processors.spec import PipelineSpec
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding, Measurements, encode_batch
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import GeneratedBatch, all_rows
from tests.support.in_memory import latest_of
from tests.support.oracle import closed_by, expected_results


@dataclass
class Collected:
    """Everything the pipeline published that a consumer sees."""

    windows: list[dict] = field(default_factory=list)
    late: list[dict] = field(default_factory=list)
    deadletters: list[bytes] = field(default_factory=list)
    confirms: dict[tuple[str, int], int] = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)
    """Alert transitions (``shoal/alerts/<pipeline>/#``), in arrival order."""

    def results_frame(self) -> pl.DataFrame:
        rows = []
        for message in self.windows:
            for result in message["results"]:
                rows.append(
                    {
                        "window": message["window"],
                        "start": message["start"],
                        "end": message["end"],
                        **result,
                    }
                )
        return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()

    def latest_frame(self) -> pl.DataFrame:
        """``results_frame`` with each (window, start, key)'s latest revision only."""
        rows = []
        for message in self.windows:
            head = {k: message[k] for k in ("window", "start", "end", "revision", "partition")}
            rows.extend({**head, **result} for result in message["results"])
        if not rows:
            return pl.DataFrame()
        return latest_of(pl.DataFrame(rows, infer_schema_length=None))

    def corrections(self) -> int:
        """Window messages that were corrections (revision above 1)."""
        return sum(1 for message in self.windows if message.get("correction"))


@contextlib.asynccontextmanager
async def collector(
    settings: BrokerSettings,
    topics: Topics,
    pipeline: str,
    *,
    session_factory: SessionFactory = AsyncSession,
) -> AsyncIterator[Collected]:
    """Collect results, late rows, dead letters, confirmations and alerts while the body runs.

    A persistent session that reconnects: what is published while the broker restarts
    waits in the session and arrives afterwards, as it would for a real consumer.
    """
    collected = Collected()
    ready = asyncio.Event()
    client_id = unique_client_id("collector")
    filters = [
        topics.results(pipeline),
        topics.late(pipeline),
        topics.deadletter(pipeline),
        topics.confirm_all(),
        topics.alerts(pipeline),
    ]
    alerts_prefix = topics.alerts(pipeline).removesuffix("#")

    def take(message: Message) -> None:
        if message.topic == topics.results(pipeline):
            collected.windows.append(orjson.loads(message.payload))
        elif message.topic == topics.late(pipeline):
            collected.late.append(orjson.loads(message.payload))
        elif message.topic == topics.deadletter(pipeline):
            collected.deadletters.append(message.payload)
        elif message.topic.startswith(alerts_prefix):
            collected.alerts.append(orjson.loads(message.payload))
        elif message.payload:
            body = orjson.loads(message.payload)
            collected.confirms[(body["gateway_id"], body["partition"])] = body["seq"]

    async def listen() -> None:
        while True:
            session = session_factory(settings, client_id, clean_start=False, session_expiry_s=600)
            try:
                async with session:
                    await session.subscribe(filters, qos=1)
                    ready.set()
                    async for message in session.messages():
                        take(message)
            except BrokerError:
                await asyncio.sleep(0.2)

    task = asyncio.create_task(listen())
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield collected
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class InProcessPipeline:
    """N workers and every combiner partition as asyncio tasks of the test process."""

    def __init__(
        self,
        spec: PipelineSpec,
        settings: BrokerSettings,
        topics: Topics,
        *,
        workers: int,
        state_dir: Path | None,
        session_factory: SessionFactory = AsyncSession,
    ) -> None:
        self.spec = spec
        # the sessions each component runs on in production, unless the test asks for others
        worker_sessions = (
            default_worker_session_factory() if session_factory is AsyncSession else session_factory
        )
        self.workers = [
            Worker(
                WorkerConfig(spec, settings, topics, worker_id=f"{topics.root}-w{i}"),
                session_factory=worker_sessions,
            )
            for i in range(workers)
        ]
        self.combiners = [
            CombinerRuntime(
                CombinerConfig(
                    spec,
                    p,
                    settings,
                    topics,
                    state_dir=None if state_dir is None else state_dir / f"p{p}",
                    tick_ms=50,
                    per_key_results=False,
                ),
                session_factory=session_factory,
                output_session_factory=(
                    default_output_session_factory()
                    if session_factory is AsyncSession
                    else session_factory
                ),
            )
            for p in range(spec.partitions)
        ]
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(c.run()) for c in self.combiners]
        self.tasks += [asyncio.create_task(w.run()) for w in self.workers]
        await asyncio.sleep(0.5)  # let every member subscribe before traffic starts

    async def stop(self) -> None:
        for component in (*self.workers, *self.combiners):
            component.stop()
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 20)

    async def crash_combiner(self, partition: int) -> None:
        """Cancel a combiner partition's task (no last checkpoint, like a kill) and start a
        fresh runtime from its checkpoint folder, as a restarted process would."""
        index = partition  # combiner tasks come first
        old = self.combiners[partition]
        await _cancel(self.tasks[index], old.stop)
        fresh = CombinerRuntime(
            old.config, session_factory=old._connect, output_session_factory=old._connect_outputs
        )
        self.combiners[partition] = fresh
        self.tasks[index] = asyncio.create_task(fresh.run())

    async def finish(self, batches: list[GeneratedBatch], seen: Collected | None = None) -> int:
        """Wait until every batch is applied and every window it fills closed, let the last
        results reach the collector (``seen``: see ``settle``), stop; the common close
        threshold."""
        last = {
            b.gateway_id: max(x.seq for x in batches if x.gateway_id == b.gateway_id)
            for b in batches
        }
        await self.wait_applied(last)
        max_ts = max(int(b.frame["ts"].max()) for b in batches if b.frame.height)
        threshold = await self.wait_closed_through(max_ts - self.spec.lateness_ms)
        await self.settle(seen)
        await self.stop()
        return threshold

    async def settle(
        self, seen: Collected | None, quiet_s: float = 0.5, timeout_s: float = 30
    ) -> None:
        """Let the last results travel to the collector ``seen``: until every publish the
        combiners started is acknowledged by the broker and nothing new reached the collector
        for ``quiet_s`` (on a loaded machine the closing partition may still be encoding and
        publishing). Without a collector: ``quiet_s``."""
        if seen is None:
            await asyncio.sleep(quiet_s)
            return
        deadline = time.monotonic() + timeout_s
        count, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            now = len(seen.windows) + len(seen.late) + len(seen.alerts)
            if now != count:
                count, since = now, time.monotonic()
            acked = all(f.done() for c in self.combiners for f in c._unacked)
            if acked and time.monotonic() - since >= quiet_s:
                return
            await asyncio.sleep(0.05)

    async def crash_worker(self, index: int) -> None:
        """Cancel a worker's task (what it held unacknowledged is redelivered or re-sent)
        and start a fresh one with the same id."""
        position = len(self.combiners) + index  # worker tasks follow the combiners'
        old = self.workers[index]
        await _cancel(self.tasks[position], old.stop)
        fresh = Worker(old.config, session_factory=old._connect)
        self.workers[index] = fresh
        self.tasks[position] = asyncio.create_task(fresh.run())

    async def resend_until_applied(
        self,
        settings: BrokerSettings,
        topics: Topics,
        batches: list[GeneratedBatch],
        *,
        encoding: Encoding,
        wait_s: float = 3.0,
        rounds: int = 10,
    ) -> None:
        """Re-send what some partition has not applied yet, as gateways' re-send timers do,
        until every partition applied everything (a crash may lose batches in flight)."""
        for _ in range(rounds):
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                missing = self._unapplied(batches)
                if not missing:
                    return
                await asyncio.sleep(0.1)
            await publish_batches(settings, topics, batches, missing, encoding=encoding)

    def _unapplied(self, batches: list[GeneratedBatch]) -> list[int]:
        done = self.applied_through()
        return [
            i for i, b in enumerate(batches) if any(d.get(b.gateway_id, -1) < b.seq for d in done)
        ]

    def applied_through(self) -> list[dict[str, int]]:
        return [c.core.confirmable() for c in self.combiners]

    async def wait_applied(self, last_seq: dict[str, int], timeout_s: float = 30) -> None:
        """Until every partition applied every gateway's batches up to ``last_seq``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(
                all(done.get(g, -1) >= seq for g, seq in last_seq.items())
                for done in self.applied_through()
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not applied in time: want {last_seq}, have {self.applied_through()}")

    async def wait_closed_through(self, end_ms: int, timeout_s: float = 30) -> int:
        """Until every partition closed windows up to ``end_ms``; returns the common threshold."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            marks = [c.core.closed_through for c in self.combiners]
            if all(m is not None and m >= end_ms for m in marks):
                return min(m for m in marks if m is not None)
            await asyncio.sleep(0.05)
        raise AssertionError(
            f"windows not closed in time: {[c.core.closed_through for c in self.combiners]}"
        )


async def until(
    check: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``check`` every 50 ms until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s"
        await asyncio.sleep(0.05)


async def _cancel(task: asyncio.Task[None], stop: Callable[[], None]) -> None:
    """Cancel a component's task like a crash. A cancellation that lands while the session
    is closing can come back as a broker error, which the component treats as a lost
    connection and reconnects; after a while ask it to stop as well (it may then write one
    more checkpoint: a restart all the same)."""
    for attempt in range(20):
        task.cancel()
        if attempt == 10:
            stop()
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            break
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def publish_batches(
    settings: BrokerSettings,
    topics: Topics,
    batches: list[GeneratedBatch],
    order: list[int],
    *,
    encoding: Encoding,
    stream: str = "s",
    session_factory: SessionFactory = AsyncSession,
    pause_every: int = 0,
    pause_s: float = 0.0,
    first_unconfirmed: int | None = None,
) -> None:
    """Announce every gateway (retained status), then publish batches in ``order``.

    The status says every seq below the smallest one given is confirmed (a combiner that
    has not seen them skips them); ``first_unconfirmed`` announces another (e.g. 0: nothing
    is confirmed yet, as a gateway whose earlier batches a combiner may have lost).

    ``pause_every`` > 0: wait for the PUBACKs and ``pause_s`` after that many batches, so
    that windows close while data still flows (late rows then reach closed windows).
    """
    by_gateway: dict[str, list[int]] = {}
    for batch in batches:
        by_gateway.setdefault(batch.gateway_id, []).append(batch.seq)
    async with session_factory(settings, unique_client_id("test-gateways")) as session:
        now = int(time.time() * 1000)
        for gateway_id, seqs in by_gateway.items():
            status = GatewayStatus(
                gateway_id,
                stream,
                max(seqs) + 1,
                min(seqs) if first_unconfirmed is None else first_unconfirmed,
                len(seqs),
                0,
                None,
                0,
                0,
                now,
            )
            await session.publish(topics.gateway_status(gateway_id), status.to_json(), retain=True)
        futures = []
        for position, index in enumerate(order):
            if pause_every and position and position % pause_every == 0:
                await session.wait_published(futures)
                futures = []
                await asyncio.sleep(pause_s)
            batch = batches[index]
            payload = encode_batch(
                Measurements.from_frame(batch.frame)
                if encoding is Encoding.BINARY_COLUMNAR
                else batch.frame,
                gateway_id=batch.gateway_id,
                seq=batch.seq,
                sent_at_ms=now,
                encoding=encoding,
            )
            futures.append(
                session.publish_started(
                    topics.ingest(stream, batch.gateway_id),
                    payload,
                    content_type=encoding.content_type,
                )
            )
        await session.wait_published(futures)


@contextlib.asynccontextmanager
async def resending(
    settings: BrokerSettings,
    topics: Topics,
    sent: list[GeneratedBatch],
    unapplied: Callable[[list[GeneratedBatch]], list[int] | None],
    *,
    encoding: Encoding,
) -> AsyncIterator[None]:
    """Re-send every second, as a gateway's spool does, the batches of ``sent`` that
    ``unapplied`` names (None: nothing to say now, e.g. in a handover)."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(1.0)
            batches = list(sent)
            if missing := unapplied(batches):
                await publish_batches(
                    settings, topics, batches, missing, encoding=encoding, first_unconfirmed=0
                )

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class OracleRun:
    """What ``run_against_oracle`` saw: the pipeline, its outputs, the oracle's late rows."""

    pipeline: InProcessPipeline
    seen: Collected
    late_count: int


async def run_live(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    order: list[int],
    *,
    settings: BrokerSettings,
    topics: Topics,
    workers: int,
    state_dir: Path | None,
    encoding: Encoding,
    session_factory: SessionFactory = AsyncSession,
) -> tuple[InProcessPipeline, Collected, int]:
    """Run the pipeline over ``batches`` published in ``order`` until every window they fill
    closed: (the pipeline, what it published, the common close threshold)."""
    pipeline = InProcessPipeline(
        spec,
        settings,
        topics,
        workers=workers,
        state_dir=state_dir,
        session_factory=session_factory,
    )
    async with collector(settings, topics, spec.name, session_factory=session_factory) as seen:
        await pipeline.start()
        await publish_batches(
            settings, topics, batches, order, encoding=encoding, session_factory=session_factory
        )
        threshold = await pipeline.finish(batches, seen)
    return pipeline, seen, threshold


async def run_against_oracle(
    spec: PipelineSpec, batches: list[GeneratedBatch], order: list[int], **live: Any
) -> OracleRun:
    """``run_live`` (``live``: its keywords); the closed windows and late rows must be the
    oracle's."""
    pipeline, seen, threshold = await run_live(spec, batches, order, **live)
    rows = all_rows(batches)
    expected, late_count = expected_results(rows, spec)
    expected = closed_by(expected, spec, threshold)
    assert_matches_oracle(seen.results_frame(), expected, spec, scale_of(rows, spec))
    assert sum(item["rows"] for item in seen.late) == late_count
    return OracleRun(pipeline, seen, late_count)


async def run_with_crash(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    order: list[int],
    *,
    settings: BrokerSettings,
    topics: Topics,
    workers: int,
    state_dir: Path,
    crash: str | None,
    encoding: Encoding,
) -> tuple[InProcessPipeline, Collected, int]:
    """Publish ``order`` in two halves with pauses; between them optionally crash
    ``combiner-<p>`` (no last checkpoint) or ``worker-<i>`` and send the first half again,
    as gateways re-send what was not confirmed; re-send until every partition applied all.
    Returns the pipeline (stopped), what it published, and the common close threshold."""
    pipeline = InProcessPipeline(spec, settings, topics, workers=workers, state_dir=state_dir)
    async with collector(settings, topics, spec.name) as seen:
        await pipeline.start()
        half = len(order) // 2
        publish: dict[str, Any] = {"encoding": encoding, "pause_every": 6, "pause_s": 0.05}
        await publish_batches(settings, topics, batches, order[:half], **publish)
        if crash is not None:
            await asyncio.sleep(0.3)  # a checkpoint or two with state in it
            kind, index = crash.split("-")
            if kind == "combiner":
                await pipeline.crash_combiner(int(index))
            else:
                await pipeline.crash_worker(int(index))
            await publish_batches(settings, topics, batches, order[:half], **publish)
        await publish_batches(settings, topics, batches, order[half:], **publish)
        try:
            if crash is not None:
                await pipeline.resend_until_applied(settings, topics, batches, encoding=encoding)
            threshold = await pipeline.finish(batches, seen)
        except BaseException:
            with contextlib.suppress(Exception):
                await pipeline.stop()
            raise
    return pipeline, seen, threshold
