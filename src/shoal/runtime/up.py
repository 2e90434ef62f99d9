"""``shoal up``: the embedded broker, a pipeline, simulated gateways and a live view, in one go.

Everything runs as child processes of this one (broker, combiners, workers, simulator), as it
would on a gateway box; this process only watches (``PipelineMonitor``) and draws. On exit it
stops the simulator (which seals and waits for its batches to be confirmed), asks the
combiners to close every open window, and prints a summary that accounts for every
measurement: generated = applied + late + dead-lettered, or the difference is reported as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TextIO

import orjson

from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.mqtt import AsyncSession, unique_client_id
from shoal.clock import SystemClock
from shoal.processors.spec import PipelineSpec
from shoal.runtime.monitor import PipelineMonitor, Snapshot
from shoal.runtime.processes import ChildProcess, connection_args, shoal_argv
from shoal.schemas.topics import Topics

SETTLE_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class UpConfig:
    """What ``shoal up`` starts.

    Attributes:
        spec: the pipeline.
        spec_source: how children find the spec (a file path or a name in processors/).
        workers: worker processes.
        profile: broker profile.
        scenario: simulator scenario (``A`` or ``B``), None for no simulated gateways.
        rate: measurements per second per sensor.
        batch: rows per batch.
        encoding: batch encoding.
        duration_s: stop after this long (None: until Ctrl-C).
        run_dir: logs and state (None: a temporary folder, removed unless ``keep``).
        keep: keep ``run_dir`` after exit.
        refresh_s: view refresh period.
    """

    spec: PipelineSpec
    spec_source: str
    workers: int = 2
    profile: str = "dev"
    scenario: str | None = "A"
    rate: float = 25.0
    batch: int = 4_000
    encoding: str = "binary"
    duration_s: float | None = None
    run_dir: Path | None = None
    keep: bool = False
    refresh_s: float = 1.0
    extra_simulate_args: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Summary:
    """The accounting printed at the end."""

    seconds: float
    generated: int
    applied: int
    late: int
    deadletters: int
    in_results: int
    windows: int
    lag_batches: int

    @property
    def lost(self) -> int:
        """Measurements generated but never applied (on time or late)."""
        return max(0, self.generated - self.applied)

    @property
    def duplicated(self) -> int:
        """Measurements counted more than once: in results or late beyond what was applied."""
        return max(0, self.in_results + self.late - self.applied)


class Up:
    """Runs the whole thing (see the module docstring)."""

    def __init__(self, config: UpConfig, out: TextIO = sys.stdout) -> None:
        self.config = config
        self.out = out
        self.topics = Topics()
        self.run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="shoal-up-"))
        self.broker = EmbeddedBroker(config.profile, data_dir=self.run_dir / "broker")
        self.children: list[ChildProcess] = []
        self.simulator: ChildProcess | None = None
        self.clock = SystemClock()
        self.monitor = PipelineMonitor(config.spec, self.topics, self.clock)
        self._stop = asyncio.Event()
        self._tty = out.isatty()

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> Summary:
        """Start everything, show the view until the duration ends or Ctrl-C, then settle."""
        self.broker.start()
        try:
            self._start_pipeline()
            return asyncio.run(self._main())
        finally:
            for child in reversed(self.children):
                child.stop()
            self.broker.close()
            if self.config.run_dir is None and not self.config.keep:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def _start_pipeline(self) -> None:
        spec = self.config.spec
        conn = connection_args(self.broker.settings, self.topics)
        env = {"POLARS_MAX_THREADS": os.environ.get("POLARS_MAX_THREADS", "1")}
        for p in range(spec.partitions):
            state = self.run_dir / "state" / f"combiner-{p}"
            self._child(
                f"combiner-{p}",
                shoal_argv(
                    "combiner",
                    "--pipeline",
                    self.config.spec_source,
                    "--partition",
                    str(p),
                    "--state-dir",
                    str(state),
                    *conn,
                ),
                env,
            )
        for i in range(self.config.workers):
            self._child(
                f"worker-{i}",
                shoal_argv("worker", "--pipeline", self.config.spec_source, *conn),
                env,
            )
        if self.config.scenario is not None:
            self.simulator = ChildProcess(
                "simulator",
                shoal_argv(
                    "simulate",
                    "--scenario",
                    self.config.scenario,
                    "--rate",
                    str(self.config.rate),
                    "--batch",
                    str(self.config.batch),
                    "--encoding",
                    self.config.encoding,
                    "--spool-dir",
                    str(self.run_dir / "spool"),
                    *self.config.extra_simulate_args,
                    *conn,
                ),
                self.run_dir / "logs" / "simulator.log",
            )

    def _child(self, name: str, argv: list[str], env: dict[str, str]) -> ChildProcess:
        child = ChildProcess(name, argv, self.run_dir / "logs" / f"{name}.log", env)
        child.start()
        self.children.append(child)
        return child

    async def _main(self) -> Summary:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        started = time.monotonic()
        async with AsyncSession(self.broker.settings, unique_client_id("shoal-up")) as session:
            await session.subscribe(self.monitor.filters(), qos=0)
            watcher = asyncio.create_task(self._watch(session))
            await asyncio.sleep(1.5)  # let workers and combiners subscribe before data flows
            if self.simulator is not None:
                self.simulator.start()
            await self._show(started)
            self._line("stopping: sealing the last batches and waiting for confirmations ...")
            await self._settle(session)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        snap = self.monitor.snapshot()
        summary = Summary(
            seconds=time.monotonic() - started,
            generated=snap.rows_generated,
            applied=snap.batch_rows_applied,
            late=snap.late_rows,
            deadletters=snap.deadletters,
            in_results=snap.rows_in_results,
            windows=snap.windows_emitted,
            lag_batches=snap.lag_batches,
        )
        self._print_summary(summary)
        return summary

    async def _watch(self, session: AsyncSession) -> None:
        async for message in session.messages():
            self.monitor.on_message(message)

    async def _show(self, started: float) -> None:
        deadline = None if self.config.duration_s is None else started + self.config.duration_s
        while not self._stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            dead = [c.name for c in self.children if not c.alive()]
            if dead:
                logs = self.run_dir / "logs"
                self._line(f"component(s) exited unexpectedly: {', '.join(dead)}; see {logs}")
                break
            self._draw(self.monitor.snapshot(), time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.config.refresh_s)

    async def _settle(self, session: AsyncSession) -> None:
        """Stop the simulator cleanly, wait for every batch to be confirmed, flush windows."""
        if self.simulator is not None:
            self.simulator.signal(signal.SIGINT)
            await asyncio.to_thread(self.simulator.wait, SETTLE_TIMEOUT_S)
        await self._until(lambda s: s.lag_batches == 0 and s.rows_generated > 0, SETTLE_TIMEOUT_S)
        await session.publish(
            self.topics.combiner_control(self.config.spec.name), orjson.dumps({"cmd": "flush"})
        )
        # Every applied measurement shows up once: in a flushed window's result, or as late.
        await self._until(
            lambda s: s.rows_in_results + s.late_rows >= s.batch_rows_applied >= s.rows_generated,
            10.0,
        )

    async def _until(self, done: Callable[[Snapshot], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(self.monitor.snapshot()):
                return True
            await asyncio.sleep(0.25)
        return False

    # -- drawing -----------------------------------------------------------------------------

    def _line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _draw(self, snap: Snapshot, elapsed: float) -> None:
        oldest = (
            "-"
            if snap.oldest_unconfirmed_age_ms is None
            else f"{snap.oldest_unconfirmed_age_ms / 1000:.1f} s"
        )
        status = (
            f"[{elapsed:5.0f} s] in {snap.rows_in_per_s:>10,.0f}/s  "
            f"out {snap.rows_out_per_s:>10,.0f}/s  "
            f"workers {len(snap.workers)}  lag {snap.lag_batches} batches / {snap.lag_rows:,} meas "
            f"(oldest {oldest})  windows {snap.windows_emitted}  late {snap.late_rows:,}  "
            f"dead letters {snap.deadletters}"
        )
        if not self._tty:
            self._line(status)
            return
        lines = [
            f"shoal up · pipeline {self.config.spec.name} · broker {self.broker.settings.url} · "
            f"logs {self.run_dir / 'logs'}",
            "",
            status,
            f"generated {snap.rows_generated:,}  applied {snap.batch_rows_applied:,}  "
            f"in results {snap.rows_in_results:,}",
            "",
            "workers:",
        ]
        for wid, body in sorted(snap.worker_metrics.items()):
            capacity = body.get("capacity_rows_per_s") or 0
            lines.append(
                f"  {wid:50.50}  busy {100 * float(body.get('busy_fraction', 0)):5.1f}%  "
                f"capacity {capacity:>12,.0f} meas/s  batches {body.get('batches', 0):,}"
            )
        lines.append("")
        lines.append("latest results:")
        names = [a for a in self.config.spec.aggregate_names if a != "count"][:6]
        for row in snap.latest:
            start = dt.datetime.fromtimestamp(int(row["start"]) / 1000, tz=dt.UTC)
            when = start.strftime("%H:%M:%S")
            values = "  ".join(
                f"{n} {row[n]:.3f}" if isinstance(row.get(n), float) else f"{n} {row.get(n)}"
                for n in names
            )
            lines.append(
                f"  {row['key']:>14}  {row['window']} @{when}  n {row['rows']:>6}  {values}"
            )
        self.out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
        self.out.flush()

    def _print_summary(self, s: Summary) -> None:
        rate = s.applied / s.seconds if s.seconds > 0 else 0.0
        verdict = (
            "zero loss" if s.lost == 0 and s.duplicated == 0 and s.lag_batches == 0 else "LOSS"
        )
        self._line(
            "\nsummary\n"
            f"  ran {s.seconds:.1f} s; {s.windows} window results\n"
            f"  measurements generated   {s.generated:>14,}\n"
            f"  applied (batches)        {s.applied:>14,}  ({rate:,.0f}/s)\n"
            f"  counted in results       {s.in_results:>14,}\n"
            f"  late (reported)          {s.late:>14,}\n"
            f"  dead letters             {s.deadletters:>14,}\n"
            f"  unconfirmed batches      {s.lag_batches:>14,}\n"
            f"  lost                     {s.lost:>14,}\n"
            f"  duplicated               {s.duplicated:>14,}\n"
            f"  verdict: {verdict}"
        )
