"""``shoal up``: the embedded broker, a pipeline, simulated gateways and a live view, in one go.

Everything runs as child processes of this one (``LocalPipeline``); this process only watches
and draws. On exit it settles the run (the simulator seals and sends its last batches, every
batch is confirmed, the combiners close every open window) and prints a summary that accounts
for every measurement: generated = applied (on time or late), or the difference is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from shoal.processors.spec import PipelineSpec
from shoal.runtime.local import Accounting, LocalPipeline, LocalPipelineConfig
from shoal.scaler.monitor import Snapshot


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
        run_dir: logs and state (None: a temporary folder).
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
    refresh_s: float = 1.0


class Up:
    """Runs the whole thing (see the module docstring)."""

    def __init__(self, config: UpConfig, out: TextIO = sys.stdout) -> None:
        self.config = config
        self.out = out
        self.local = LocalPipeline(
            LocalPipelineConfig(
                spec=config.spec,
                spec_source=config.spec_source,
                workers=config.workers,
                profile=config.profile,
                run_dir=config.run_dir,
            )
        )
        self._stop = asyncio.Event()
        self._tty = out.isatty()

    def run(self) -> Accounting:
        """Start everything, show the view until the duration ends or Ctrl-C, then settle."""
        try:
            self.local.start()
            return asyncio.run(self._main())
        finally:
            self.local.stop()

    async def _main(self) -> Accounting:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        started = time.monotonic()
        async with self.local.watching() as session:
            await asyncio.sleep(1.5)  # let workers and combiners subscribe before data flows
            if self.config.scenario is not None:
                self.local.start_simulator(
                    [
                        "--scenario",
                        self.config.scenario,
                        "--rate",
                        str(self.config.rate),
                        "--batch",
                        str(self.config.batch),
                        "--encoding",
                        self.config.encoding,
                        "--spool-dir",
                        str(self.local.run_dir / "spool"),
                        # Until we stop it (SIGINT makes it seal, send and report).
                        "--duration",
                        str(365 * 86_400),
                    ]
                )
            await self._show(started)
            self._line("stopping: sealing the last batches and waiting for confirmations ...")
            accounting = await self.local.settle(session)
        self._print_summary(accounting, time.monotonic() - started)
        return accounting

    async def _show(self, started: float) -> None:
        deadline = None if self.config.duration_s is None else started + self.config.duration_s
        while not self._stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return
            dead = self.local.dead_children()
            if dead:
                self._line(
                    f"component(s) exited unexpectedly: {', '.join(dead)}; see {self.local.logs}"
                )
                return
            self._draw(self.local.monitor.snapshot(), time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.config.refresh_s)

    def _line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _draw(self, snap: Snapshot, elapsed: float) -> None:
        age = snap.oldest_unconfirmed_age_ms
        oldest = "-" if age is None else f"{age / 1000:.1f} s"
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
            f"shoal up · pipeline {self.config.spec.name} · broker "
            f"{self.local.broker.settings.url} · logs {self.local.logs}",
            "",
            status,
            f"generated {snap.rows_generated:,}  applied {snap.batch_rows_applied:,}  "
            f"in results {snap.rows_in_results:,}",
            "",
            "workers:",
        ]
        for wid, body in sorted(snap.worker_metrics.items()):
            capacity = body.get("capacity_rows_per_s") or 0
            busy = 100 * float(body.get("busy_fraction", 0))
            lines.append(
                f"  {wid:50.50}  busy {busy:5.1f}%  capacity {capacity:>12,.0f} meas/s  "
                f"batches {body.get('batches', 0):,}"
            )
        lines += ["", "latest results:"]
        names = [a for a in self.config.spec.aggregate_names if a != "count"][:6]
        for row in snap.latest:
            start = dt.datetime.fromtimestamp(int(row["start"]) / 1000, tz=dt.UTC)
            values = "  ".join(
                f"{n} {row[n]:.3f}" if isinstance(row.get(n), float) else f"{n} {row.get(n)}"
                for n in names
            )
            when = f"{row['window']} @{start:%H:%M:%S}"
            lines.append(f"  {row['key']:>14}  {when}  n {row['rows']:>6}  {values}")
        self.out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
        self.out.flush()

    def _print_summary(self, a: Accounting, seconds: float) -> None:
        rate = a.applied / seconds if seconds > 0 else 0.0
        snap = self.local.monitor.snapshot()
        self._line(
            "\nsummary\n"
            f"  ran {seconds:.1f} s; {snap.windows_emitted} window results\n"
            f"  measurements generated   {a.generated:>14,}\n"
            f"  applied                  {a.applied:>14,}  ({rate:,.0f}/s)\n"
            f"  counted in results       {a.in_results:>14,}\n"
            f"  late (reported)          {a.late:>14,}\n"
            f"  dead letters             {a.deadletters:>14,}\n"
            f"  unconfirmed batches      {a.unconfirmed_batches:>14,}\n"
            f"  lost                     {a.lost:>14,}\n"
            f"  duplicated               {a.duplicated:>14,}\n"
            f"  verdict: {'zero loss' if a.exact else 'LOSS OR DUPLICATES (see above)'}"
        )
