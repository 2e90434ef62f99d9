"""A whole pipeline on this machine: embedded broker, combiners, workers, simulated gateways.

Every part runs in its own process, as on a gateway box; ``LocalPipeline`` starts them, feeds
a ``PipelineMonitor`` with what they publish, and settles the run at the end: the simulator
seals and sends its last batches, every batch is confirmed, and the combiners close every
open window, so that every generated measurement is accounted for. ``shoal up`` draws it;
``shoal bench pipeline`` measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import orjson
import psutil

from shoal._processes import ChildProcess, connection_args, shoal_argv
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.mqtt import AsyncSession, unique_client_id
from shoal.clock import SystemClock
from shoal.processors.spec import PipelineSpec
from shoal.scaler.backends import LocalBackend
from shoal.scaler.monitor import PipelineMonitor, Snapshot
from shoal.schemas.topics import Topics

SETTLE_TIMEOUT_S: Final = 120.0


@dataclass(frozen=True, slots=True)
class LocalPipelineConfig:
    """What to start.

    Attributes:
        spec: the pipeline.
        spec_source: how child processes find the spec (file path or name in processors/).
        workers: worker processes.
        profile: broker profile.
        run_dir: logs, spools and checkpoints (None: a temporary folder, removed at the end).
        per_key_results: publish the retained per-key result topics.
    """

    spec: PipelineSpec
    spec_source: str
    workers: int = 2
    profile: str = "dev"
    run_dir: Path | None = None
    per_key_results: bool = True


@dataclass
class Accounting:
    """Where every generated measurement went, once a run has settled."""

    generated: int
    applied: int
    in_results: int
    late: int
    deadletters: int
    unconfirmed_batches: int

    @property
    def lost(self) -> int:
        """Generated but never applied (neither on time nor late)."""
        return max(0, self.generated - self.applied)

    @property
    def duplicated(self) -> int:
        """Counted more than once (in window results or late reports)."""
        return max(0, self.in_results + self.late - self.applied)

    @property
    def exact(self) -> bool:
        """Nothing lost, nothing duplicated, nothing left unconfirmed."""
        return self.lost == 0 and self.duplicated == 0 and self.unconfirmed_batches == 0


@dataclass
class _Usage:
    name: str
    process: psutil.Process
    cpu_start: float
    wall_start: float
    cpu_last: float = 0.0
    rss_peak: int = 0


@dataclass
class ResourceSampler:
    """CPU seconds and peak RSS of named processes over a run (sampled, psutil)."""

    usages: dict[str, _Usage] = field(default_factory=dict)

    def watch(self, name: str, pid: int | None) -> None:
        """Start measuring a process."""
        if pid is None:
            return
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            times = process.cpu_times()
            self.usages[name] = _Usage(name, process, times.user + times.system, time.monotonic())

    def sample(self) -> None:
        """Take one sample of every watched process."""
        for usage in self.usages.values():
            with contextlib.suppress(psutil.Error):
                times = usage.process.cpu_times()
                usage.cpu_last = times.user + times.system
                usage.rss_peak = max(usage.rss_peak, usage.process.memory_info().rss)

    def report(self) -> list[dict[str, object]]:
        """Per process: name, CPU % of one core over the run, peak RSS in MB."""
        now = time.monotonic()
        out = []
        for usage in self.usages.values():
            wall = max(now - usage.wall_start, 1e-9)
            out.append(
                {
                    "name": usage.name,
                    "cpu_percent": round(100.0 * (usage.cpu_last - usage.cpu_start) / wall, 1),
                    "cpu_seconds": round(usage.cpu_last - usage.cpu_start, 3),
                    "rss_mb": round(usage.rss_peak / 1e6, 1),
                }
            )
        return out


class LocalPipeline:
    """Broker, combiners and workers as child processes, and a monitor watching them."""

    def __init__(self, config: LocalPipelineConfig) -> None:
        self.config = config
        self.topics = Topics()
        self.run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="shoal-run-"))
        self.broker = EmbeddedBroker(config.profile, data_dir=self.run_dir / "broker")
        self.children: list[ChildProcess] = []
        self.simulators: list[ChildProcess] = []
        self.backend = LocalBackend(self._spawn_worker)
        self._worker_numbers = itertools.count()
        self.clock = SystemClock()
        self.monitor = PipelineMonitor(config.spec, self.topics, self.clock)
        self.sampler = ResourceSampler()

    @property
    def logs(self) -> Path:
        """Where child processes write their output."""
        return self.run_dir / "logs"

    def start(self) -> None:
        """Broker first, then combiners, then workers."""
        self.broker.start()
        self.sampler.watch("broker", self.broker.pid)
        spec = self.config.spec
        conn = connection_args(self.broker.settings, self.topics)
        for p in range(spec.partitions):
            argv = [
                "combiner",
                "--pipeline",
                self.config.spec_source,
                "--partition",
                str(p),
                "--state-dir",
                str(self.run_dir / "state" / f"combiner-{p}"),
                *conn,
            ]
            if not self.config.per_key_results:
                argv.append("--no-key-topics")
            self._start_child(f"combiner-{p}", argv)
        self.backend.scale_to(self.config.workers)

    @property
    def workers(self) -> list[ChildProcess]:
        """Live workers (the backend replaces crashed ones and drains surplus ones)."""
        return self.backend.live

    @property
    def simulator(self) -> ChildProcess | None:
        """The first simulator started, if any."""
        return self.simulators[0] if self.simulators else None

    def _spawn_worker(self) -> ChildProcess:
        name = f"worker-{next(self._worker_numbers)}"
        conn = connection_args(self.broker.settings, self.topics)
        child = ChildProcess(
            name,
            shoal_argv("worker", "--pipeline", self.config.spec_source, *conn),
            self.logs / f"{name}.log",
            self._child_env(),
        )
        child.start()
        self.sampler.watch(name, child.pid)
        return child

    def start_simulator(self, args: list[str], name: str = "simulator") -> ChildProcess:
        """Start ``shoal simulate`` with ``args`` against this broker."""
        conn = connection_args(self.broker.settings, self.topics)
        simulator = ChildProcess(
            name, shoal_argv("simulate", *args, *conn), self.logs / f"{name}.log"
        )
        simulator.start()
        self.simulators.append(simulator)
        self.sampler.watch(name, simulator.pid)
        return simulator

    def _child_env(self) -> dict[str, str]:
        # Children log to files: INFO there costs nothing and explains what happened.
        return {
            "POLARS_MAX_THREADS": os.environ.get("POLARS_MAX_THREADS", "1"),
            "SHOAL_LOG_LEVEL": "INFO",
        }

    def _start_child(self, name: str, argv: list[str]) -> ChildProcess:
        child = ChildProcess(name, shoal_argv(*argv), self.logs / f"{name}.log", self._child_env())
        child.start()
        self.children.append(child)
        self.sampler.watch(name, child.pid)
        return child

    def dead_children(self) -> list[str]:
        """Names of pipeline processes (combiners) that exited; workers are replaced instead."""
        return [c.name for c in self.children if not c.alive()]

    def stop(self) -> None:
        """Stop everything (children, then the broker) and clean up a temporary run folder."""
        for simulator in self.simulators:
            simulator.stop()
        self.backend.close()
        for child in reversed(self.children):
            child.stop()
        self.broker.close()
        if self.config.run_dir is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[AsyncSession]:
        """Feed the monitor (and sample resources) while the body runs."""
        async with AsyncSession(self.broker.settings, unique_client_id("shoal-monitor")) as session:
            await session.subscribe(self.monitor.filters(), qos=0)

            async def feed() -> None:
                async for message in session.messages():
                    self.monitor.on_message(message)

            async def sample() -> None:
                while True:
                    self.sampler.sample()
                    self.backend.observe()  # reap drained workers, replace crashed ones
                    await asyncio.sleep(0.5)

            tasks = [asyncio.create_task(feed()), asyncio.create_task(sample())]
            try:
                yield session
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(
        self, session: AsyncSession, timeout_s: float = SETTLE_TIMEOUT_S
    ) -> Accounting:
        """Stop the simulator cleanly, wait for every confirmation, flush windows, account."""
        for simulator in self.simulators:
            if simulator.alive():
                simulator.signal(signal.SIGINT)
        for simulator in self.simulators:
            await asyncio.to_thread(simulator.wait, timeout_s)
        ran = bool(self.simulators)
        await self.until(
            lambda s: s.lag_batches == 0 and (s.rows_generated > 0 or not ran), timeout_s
        )
        await session.publish(
            self.topics.combiner_control(self.config.spec.name), orjson.dumps({"cmd": "flush"})
        )
        await self.until(
            lambda s: s.rows_in_results + s.late_rows >= s.batch_rows_applied >= s.rows_generated,
            min(timeout_s, 30.0),
        )
        await asyncio.sleep(0.5)  # late duplicates, if any, would show up now
        snap = self.monitor.snapshot()
        return Accounting(
            generated=snap.rows_generated,
            applied=snap.batch_rows_applied,
            in_results=snap.rows_in_results,
            late=snap.late_rows,
            deadletters=snap.deadletters,
            unconfirmed_batches=snap.lag_batches,
        )

    async def until(self, done: Callable[[Snapshot], bool], timeout_s: float) -> bool:
        """Wait until ``done(snapshot)`` or the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(self.monitor.snapshot()):
                return True
            await asyncio.sleep(0.25)
        return False
