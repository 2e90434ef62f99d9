"""``shoal archive`` as a library: subscribe to raw batches and/or results, write Parquet.

The ``Archiver`` reads the ingest topics with a normal (not shared) subscription, so it sees
every batch next to the workers, and the window result topics. Messages go into an
``ArchiveWriter``; a ticker rolls partitions over (size, age, memory budget) and a writer task
writes the files on a worker thread, so receiving never waits for the disk unless the memory
budget is exhausted (then it stops reading until a file is written: TCP backpressure, never
an unbounded queue).

Without a ``client_id`` the session is clean and private. With one, the session is persistent
(``session_expiry_s``): while the archiver restarts, the broker queues what it misses, up to
its per-client queue limit. Rows buffered when the process is killed are lost; ``stop`` (and
SIGINT/SIGTERM in the CLI) writes them out first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from shoal.archive.rollover import RolloverPolicy
from shoal.archive.writer import ArchiveWriter, Compression, FileJob, WrittenFile
from shoal.broker import default_session_factory
from shoal.broker.session import Message, SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SystemClock
from shoal.errors import BrokerError, SchemaError
from shoal.schemas.results import parse_window_message
from shoal.schemas.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ArchiveConfig:
    """What to archive, where, and how files roll over.

    Attributes:
        root: the archive folder.
        broker: where the broker is.
        topics: the deployment's topic namespace.
        batches: archive raw batches.
        results: archive window results.
        inputs: ingest topic filters (relative to the topic root) for raw batches.
        pipelines: pipelines whose results to archive (empty: every pipeline).
        policy: rollover thresholds and memory budget.
        compression: Parquet codec.
        client_id: stable MQTT client id for a persistent session ("" : a private one).
        session_expiry_s: how long the broker keeps a persistent session.
        tick_s: how often partitions are checked for rollover by age.
    """

    root: Path
    broker: BrokerSettings
    topics: Topics = field(default_factory=Topics)
    batches: bool = True
    results: bool = True
    inputs: tuple[str, ...] = ("ingest/+/+",)
    pipelines: tuple[str, ...] = ()
    policy: RolloverPolicy = field(default_factory=RolloverPolicy)
    compression: Compression = "zstd"
    client_id: str = ""
    session_expiry_s: int = 3_600
    tick_s: float = 0.5

    def filters(self) -> list[str]:
        """Topic filters to subscribe to."""
        out = []
        if self.batches:
            out += [self.topics.under_root(f) for f in self.inputs]
        if self.results:
            if self.pipelines:
                out += [self.topics.results(p) for p in self.pipelines]
            else:
                out.append(self.topics.under_root("results/+"))
        return out


@dataclass
class ArchiveReport:
    """What an archiver did: counts, files and its own CPU use."""

    received_batches: int
    received_results: int
    unreadable_results: int
    duplicate_results: int
    files: int
    files_by_kind: dict[str, int]
    rows_written: int
    file_bytes: int
    write_seconds: float
    peak_buffered_bytes: int
    backpressure_waits: int
    max_queued_files: int
    reconnects: int
    wall_s: float
    cpu_s: float

    @property
    def cpu_percent(self) -> float:
        """CPU time over wall time, in % of one core (this process)."""
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return {**asdict(self), "cpu_percent": round(self.cpu_percent, 1)}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Archiver:
    """Runs until ``stop``; reconnects after broker failures (see the module docstring).

    ``session_factory`` opens its MQTT sessions (default: ``default_session_factory()``).
    """

    def __init__(
        self,
        config: ArchiveConfig,
        clock: Clock | None = None,
        *,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self._connect = session_factory or default_session_factory()
        self.writer = ArchiveWriter(
            config.root,
            config.policy,
            compression=config.compression,
            monotonic=self.clock.monotonic,
        )
        self.connected = asyncio.Event()
        self.received_batches = 0
        self.received_results = 0
        self.backpressure_waits = 0
        self.max_queued_files = 0
        self.reconnects = 0
        self.written: deque[WrittenFile] = deque(maxlen=10_000)  # the most recent files
        self._stop = asyncio.Event()
        self._jobs: asyncio.Queue[FileJob] = asyncio.Queue()
        self._written_event = asyncio.Event()
        self._started = self.clock.monotonic()
        self._cpu_start = _cpu_s()
        root = config.topics.root.rstrip("/")
        self._prefix = f"{root}/" if root else ""

    def stop(self) -> None:
        """Finish: write every buffered row, then return from ``run``."""
        self._stop.set()

    async def run(self) -> ArchiveReport:
        """Archive until ``stop``; returns the report once every buffered row is written."""
        self._started = self.clock.monotonic()
        self._cpu_start = _cpu_s()
        tasks = [asyncio.create_task(self._write_files()), asyncio.create_task(self._tick())]
        try:
            await self._receive()
        finally:
            for job in self.writer.take_due(everything=True):
                self._jobs.put_nowait(job)
            await self._jobs.join()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self.report()

    def report(self) -> ArchiveReport:
        """The counters so far."""
        stats = self.writer.stats
        return ArchiveReport(
            received_batches=self.received_batches,
            received_results=self.received_results,
            unreadable_results=stats.unreadable_results,
            duplicate_results=stats.duplicate_results,
            files=stats.files,
            files_by_kind=dict(stats.by_kind),
            rows_written=stats.rows_written,
            file_bytes=stats.file_bytes,
            write_seconds=round(stats.write_seconds, 3),
            peak_buffered_bytes=stats.peak_buffered_bytes,
            backpressure_waits=self.backpressure_waits,
            max_queued_files=self.max_queued_files,
            reconnects=self.reconnects,
            wall_s=round(self.clock.monotonic() - self._started, 3),
            cpu_s=round(_cpu_s() - self._cpu_start, 3),
        )

    async def _receive(self) -> None:
        config = self.config
        persistent = bool(config.client_id)
        while not self._stop.is_set():
            session = self._connect(
                config.broker,
                config.client_id or unique_client_id("shoal-archive"),
                clean_start=not persistent,
                session_expiry_s=config.session_expiry_s if persistent else 0,
            )
            try:
                async with session:
                    await session.subscribe(config.filters(), qos=1)
                    self.connected.set()
                    async for message in session.messages_until(self._stop):
                        self._on_message(message)
                        self._roll(self.writer.take_due())
                        while self.writer.over_budget and not self._stop.is_set():
                            self.backpressure_waits += 1
                            self._written_event.clear()
                            await self._written_event.wait()
            except BrokerError as exc:
                self.connected.clear()
                if self._stop.is_set():
                    break
                self.reconnects += 1
                log.warning("archive: %s; reconnecting", exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._stop.wait()

    def _on_message(self, message: Message) -> None:
        now = self.clock.now_ms()
        topics = self.config.topics
        route = topics.ingest_gateway(message.topic)
        if route is not None:
            self.received_batches += 1
            relative = message.topic[len(self._prefix) :]
            self.writer.add_batch(route[0], relative, message.payload, message.content_type, now)
            return
        self.received_results += 1
        try:
            parsed = parse_window_message(message.payload, message.content_type)
        except SchemaError as exc:
            self.writer.stats.unreadable_results += 1
            log.warning("archive: skipping an unreadable result on %s: %s", message.topic, exc)
            return
        self.writer.add_results(parsed, now)

    def _roll(self, jobs: list[FileJob]) -> None:
        for job in jobs:
            self._jobs.put_nowait(job)
        self.max_queued_files = max(self.max_queued_files, self._jobs.qsize())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self._roll(self.writer.take_due())

    async def _write_files(self) -> None:
        while True:
            job = await self._jobs.get()
            written: WrittenFile | None = None
            try:
                written = await asyncio.to_thread(self.writer.write_job, job)
                self.written.append(written)
            except (OSError, pl.exceptions.PolarsError):
                log.exception(
                    "archive: could not write %s (%d rows lost)", job.path, len(job.frame)
                )
            finally:
                self.writer.done(job, written)
                self._written_event.set()
                self._jobs.task_done()
