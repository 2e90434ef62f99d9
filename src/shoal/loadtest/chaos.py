"""``shoal bench chaos``: the whole pipeline under repeated faults, judged by a count oracle.

A ``LocalPipeline`` (broker, combiner partitions and workers as processes, workers run by the
scaler's local backend) runs ``CHAOS_PIPELINE`` while simulated gateways offer a steady base
load from disk spools. Over ``duration_s`` seconds:

1. a capacity probe: the workers at the scaler's maximum, a second simulator offers far more
   than they can take for ``probe_s`` seconds; capacity = measurements applied per second while
   the backlog grew (skipped when ``capacity`` is given);
2. every ``kill_interval_s``, a kill -9 of a random worker or combiner (the backend replaces a
   worker at once, a combiner is started again after ``revive_after_s``);
3. at fixed points: a network pause (a worker SIGSTOPped for ``pause_s``, then SIGCONT), a
   broker SIGKILL and restart (same port, same persistence), a gateway restart (the base
   simulator stopped and started again on the same spools), a second pause, and an overload
   phase: ``overload_factor`` x the capacity for ``overload_s`` seconds with the workers at the
   scaler's maximum.

Then the load stops; gateways whose simulator has exited are drained in this process (their
spools re-sent until confirmed); the combiners flush; and the run is accounted with the
gateways' own counts (measurements sealed into their spools, from the simulators' reports)
against a deduplicating consumer of results and late reports (``_ledger``): lost =
published - (results + late), duplicated = the excess, both must be 0. Peak RSS of every
component is reported and checked against a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from shoal._processes import ChildProcess
from shoal.broker import AsyncSession
from shoal.broker.session import unique_client_id
from shoal.gateway import Gateway, GatewayConfig
from shoal.loadtest._ledger import Ledger, follow
from shoal.loadtest.bench_pipeline import machine
from shoal.processors.spec import PipelineSpec, load_pipeline
from shoal.runtime.local import LocalPipeline, LocalPipelineConfig
from shoal.runtime.scaler import Scaler, ScalerConfig
from shoal.scaler.policy import Bounds

CHAOS_PIPELINE: Final = """\
# The pipeline of `shoal bench chaos`: two combiner partitions, two window specs (so each
# measurement costs a realistic amount of work), every aggregate.
name = "chaos"
inputs = ["ingest/+/+"]
key = "sensor_id"
lateness_ms = 1000
idle_timeout_ms = 3000
partitions = 2
checkpoint_interval_ms = 500
output_encodings = ["json"]
aggregates = ["count", "mean", "min", "max", "stddev", "first", "last", "p50", "p95", "p99"]

[[windows]]
kind = "tumbling"
size_ms = 2000

[[windows]]
kind = "hopping"
size_ms = 4000
slide_ms = 2000
"""

STREAM: Final = "chaos"
PREFIXES: Final = {"base": "base-gw", "probe": "probe-gw", "burst": "burst-gw"}
LATE_BY_MS: Final = 5_000
"""How far back late rows are stamped: past their windows' close, within the allowance."""
START_TIMEOUT_S: Final = 60.0
"""How long a probe or burst simulator may take to start (to import shoal, on a busy machine)."""
BURST_SENSORS: Final = 2_000
"""Sensors per gateway of the probe and burst simulators (their rate is set per run)."""


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """One chaos run.

    Attributes:
        duration_s: length of the faulty part of the run (load, faults, overload).
        min_workers: the scaler's minimum.
        max_workers: the scaler's maximum (probe and overload run at it).
        gateways: base-load gateways.
        sensors: sensors per base gateway.
        rate_hz: measurements per second per base sensor.
        batch: rows per batch.
        kill_interval_s: time between two kill -9.
        revive_after_s: how long a killed combiner stays dead.
        pause_s: how long a paused worker stays stopped.
        broker_down_s: how long the broker stays dead.
        probe_s: length of the capacity probe.
        probe_rate: measurements per second the probe offers (far above capacity).
        capacity: skip the probe and use this capacity (measurements per second).
        overload_factor: offered load during overload, as a multiple of capacity.
        overload_s: length of the overload phase.
        scaler: run the lag scaler between min and max workers (False: fixed max workers).
        profile: broker profile (``secure`` runs every component with its own role).
        seed: choice of kill victims.
        late_share: share of base-load measurements stamped ``LATE_BY_MS`` back: late for
            their window, within the pipeline's allowed lateness, so they come back as
            corrections (revised results) while combiners are killed; a restored combiner
            re-takes its logged closes, so every copy of a window revision has the same
            rows (the ledger counts a different one as a conflict). 0: no late rows, and
            the pipeline allows no lateness.
        rss_limit_mb: peak RSS allowed per component.
        settle_timeout_s: how long draining and flushing may take at the end.
        run_dir: logs, spools, checkpoints (None: a temporary folder, removed afterwards).
    """

    duration_s: float = 120.0
    min_workers: int = 2
    max_workers: int = 4
    gateways: int = 2
    sensors: int = 500
    rate_hz: float = 20.0
    batch: int = 4_000
    kill_interval_s: float = 5.0
    revive_after_s: float = 1.0
    pause_s: float = 4.0
    broker_down_s: float = 1.5
    probe_s: float = 4.0
    probe_rate: float = 600_000.0
    capacity: float | None = None
    overload_factor: float = 2.0
    overload_s: float = 12.0
    scaler: bool = True
    profile: str = "dev"
    seed: int = 0
    late_share: float = 0.002
    rss_limit_mb: float = 1_500.0
    settle_timeout_s: float = 240.0
    run_dir: Path | None = None

    @property
    def base_rate(self) -> float:
        """Measurements per second of the base load."""
        return self.gateways * self.sensors * self.rate_hz


@dataclass
class _Sample:
    t: float
    applied: int
    at_ms: int
    lag_rows: int
    workers: int


@dataclass
class _Phase:
    kind: str
    start: float
    end: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


class ChaosRun:
    """One run (see the module docstring); ``run()`` returns the JSON record."""

    def __init__(self, config: ChaosConfig, progress: TextIO | None = None) -> None:
        self.config = config
        self.progress = progress
        self.run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="shoal-chaos-"))
        spec_path = self.run_dir / "chaos.toml"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        # With --late-share, late rows (stamped LATE_BY_MS back) fold into closed windows as
        # corrections, through every kill and restart.
        corrections = "allowed_lateness_ms = 8000\n" if config.late_share > 0 else ""
        spec_path.write_text(corrections + CHAOS_PIPELINE)
        self.spec: PipelineSpec = load_pipeline(spec_path)
        ids = tuple(
            f"{prefix}{i:03d}"
            for kind, prefix in PREFIXES.items()
            for i in range(config.gateways if kind == "base" else 2)
        )
        self.local = LocalPipeline(
            LocalPipelineConfig(
                spec=self.spec,
                spec_source=str(spec_path),
                workers=config.max_workers,
                profile=config.profile,
                run_dir=self.run_dir / "pipeline",
                per_key_results=False,
                gateway_ids=ids,
            )
        )
        self.ledger = Ledger(self.spec.name, self.spec.windows[0].name)
        self.rng = random.Random(config.seed)
        self.events: list[dict[str, Any]] = []
        self.phases: list[_Phase] = []
        self.samples: list[_Sample] = []
        self.reports: list[Path] = []
        self.drainers: list[Gateway] = []
        self.kills: dict[str, int] = {"worker": 0, "combiner": 0}
        self.pinned = True  # the scaler waits until the probe is done
        self.broker_down = False
        self.scaler: Scaler | None = None
        self.capacity: float | None = config.capacity
        self.t0 = 0.0
        self._incarnations = 0
        self._background: list[asyncio.Task[None]] = []

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Start everything, break it, settle it, account for it; always cleans up."""
        try:
            self.local.start()
            return asyncio.run(self._main())
        finally:
            for gateway in self.drainers:
                gateway.close(timeout_s=0)
            self.local.stop()
            if self.config.run_dir is None:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _main(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.scaler:
            self.scaler = Scaler(
                ScalerConfig(
                    self.spec,
                    self.local.credentials("admin"),
                    self.local.topics,
                    bounds=Bounds(cfg.min_workers, cfg.max_workers),
                    http_port=None,
                ),
                self.local.backend,
                monitor=self.local.monitor,
            )
        ready = asyncio.Event()
        background = [
            asyncio.create_task(self._feed_monitor()),
            asyncio.create_task(
                follow(
                    self.local.credentials("admin"),
                    self.local.topics,
                    self.ledger,
                    unique_client_id("chaos-ledger"),
                    ready,
                )
            ),
            asyncio.create_task(self._housekeeping()),
        ]
        try:
            await asyncio.wait_for(ready.wait(), 15)
            self.t0 = time.monotonic()
            self._start_base()
            await self._faulty_part()
            return await self._settle()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)

    async def _faulty_part(self) -> None:
        cfg = self.config
        await self._sleep_until(1.0)
        if self.capacity is None:
            await self._probe()
        self.pinned = False
        killer = asyncio.create_task(self._killer())
        schedule: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (0.25, lambda: self._pause("pause")),
            (0.40, self._broker_crash),
            (0.52, self._gateway_restart),
            (0.62, self._overload),
            (0.88, lambda: self._pause("pause")),
        ]
        try:
            for fraction, action in schedule:
                await self._sleep_until(fraction * cfg.duration_s)
                await action()
            await self._sleep_until(cfg.duration_s)
        finally:
            killer.cancel()
            await asyncio.gather(killer, return_exceptions=True)
            for partition in range(self.spec.partitions):  # one may have died just now
                self.local.revive(f"combiner-{partition}")
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            for phase in self.phases:
                if phase.kind == "overload" and "drained_after_s" not in phase.details:
                    phase.details["drained_after_s"] = None
                    phase.details["peak_lag_measurements"] = max(
                        (s.lag_rows for s in self.samples if s.t >= phase.start), default=0
                    )

    # -- load ------------------------------------------------------------------------------------

    def _simulator(
        self, kind: str, sensors: int, rate_hz: float, duration_s: float
    ) -> ChildProcess:
        self._incarnations += 1
        report = self.run_dir / f"simulator-{kind}-{self._incarnations}.json"
        self.reports.append(report)
        gateways = self.config.gateways if kind == "base" else 2
        args = [
            "--gateways", str(gateways), "--sensors", str(sensors), "--rate", f"{rate_hz:.6g}",
            "--batch", str(self.config.batch), "--encoding", "binary",
            "--duration", f"{duration_s:.3f}", "--spool", "disk",
            "--spool-dir", str(self.run_dir / "spool"), "--gateway-prefix", PREFIXES[kind],
            "--stream", STREAM, "--seed", str(self._incarnations), "--json", str(report),
            "--quiet",
        ]  # fmt: skip
        if kind == "base" and self.config.late_share > 0:
            args += ["--late-share", f"{self.config.late_share:g}", "--late-by-ms", str(LATE_BY_MS)]
        return self.local.start_simulator(args, name=f"simulator-{kind}")

    def _start_base(self) -> None:
        # Runs past the end of the faulty part: the run stops it (and drains its spools).
        cfg = self.config
        remaining = cfg.duration_s - self._now()
        self._simulator("base", cfg.sensors, cfg.rate_hz, max(1.0, remaining) + 60.0)

    async def _stop(self, simulator: ChildProcess, timeout_s: float = 60.0) -> None:
        simulator.signal(signal.SIGINT)  # seal, publish, write the report, keep the spool
        if await asyncio.to_thread(simulator.wait, timeout_s) is None:
            raise RuntimeError(f"{simulator.name} did not stop; see {simulator.log_path}")

    async def _drain(self, kind: str) -> None:
        """Gateways of a finished simulator: re-send their spools until confirmed."""
        count = self.config.gateways if kind == "base" else 2
        for i in range(count):
            gateway_id = f"{PREFIXES[kind]}{i:03d}"
            config = GatewayConfig(
                gateway_id,
                stream=STREAM,
                broker=self.local.credentials("simulator"),
                topics=self.local.topics,
                spool_dir=self.run_dir / "spool" / gateway_id,
                # A worker killed during a backlog takes its whole broker queue with it (a
                # clean session); re-send in larger rounds than a field gateway would.
                resend_after_ms=1_000,
                resend_window=64,
            )
            gateway = await asyncio.to_thread(Gateway, config)
            self.drainers.append(gateway.start())

    # -- faults ----------------------------------------------------------------------------------

    async def _killer(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.kill_interval_s)
            if self.broker_down:
                continue
            workers = [w.name for w in self.local.backend.live if w.alive()]
            combiners = [f"combiner-{p}" for p in range(self.spec.partitions)]
            kind = "worker" if workers and self.rng.random() < 0.6 else "combiner"
            victim = self.rng.choice(workers if kind == "worker" else combiners)
            await asyncio.to_thread(self.local.kill, victim)
            self.kills[kind] += 1
            self._event("kill", victim)
            if kind == "combiner":
                await asyncio.sleep(cfg.revive_after_s)
                self.local.revive(victim)
                self._event("revive", victim)

    async def _pause(self, kind: str) -> None:
        workers = [w.name for w in self.local.backend.live if w.alive()]
        if not workers:
            return
        victim = self.rng.choice(workers)
        phase = self._phase(kind, target=victim)
        paused = self.local.pause(victim)
        try:
            await asyncio.sleep(self.config.pause_s)
        finally:
            self.local.resume(paused)
            phase.end = self._now()

    async def _broker_crash(self) -> None:
        phase = self._phase("broker_restart")
        self.broker_down = True
        try:
            await asyncio.to_thread(self.local.crash_broker, self.config.broker_down_s)
        finally:
            self.broker_down = False
            phase.end = self._now()

    async def _gateway_restart(self) -> None:
        phase = self._phase("gateway_restart")
        base = self.local.process("simulator-base")
        await self._stop(base)
        self.local.simulators.remove(base)
        self._start_base()
        phase.end = self._now()

    # -- capacity and overload -------------------------------------------------------------------

    async def _probe(self) -> None:
        cfg = self.config
        self.local.backend.scale_to(cfg.max_workers)
        phase = self._phase("capacity_probe", workers=cfg.max_workers, offered=cfg.probe_rate)
        simulator = self._simulator(
            "probe", BURST_SENSORS, cfg.probe_rate / (2 * BURST_SENSORS), cfg.probe_s + 20.0
        )
        # Measure from the moment a backlog exists (the simulator has started and outruns
        # the pipeline) for probe_s seconds, on the combiner's clock.
        start = await self._until_backlog("probe", 15.0)
        await asyncio.sleep(cfg.probe_s)
        end = self._now()
        await self._stop(simulator)
        rate, lag_grew = self._applied_rate(start, end)
        self.capacity = rate
        phase.details.update(
            capacity_meas_per_s=round(rate, 1),
            measured_s=round(end - start, 1),
            saturated=lag_grew,
            probe_simulator=_read(self.reports[-1]),
        )
        await self._drain("probe")
        drained = await self._until_drained(40.0)
        phase.details["drained_after_s"] = None if drained is None else round(drained - end, 1)
        phase.end = self._now()

    async def _until_backlog(self, kind: str, timeout_s: float) -> float:
        """Wait until the ``kind`` simulator runs and a few batches wait; returns then.

        Running: one of its gateways has announced itself. A backlog alone does not say so
        (kills leave one behind), and a simulator stopped while Python still imports it
        (seconds on a loaded machine) seals nothing and writes no report, so the run could
        not account for it. It may take up to ``START_TIMEOUT_S`` to start.
        """
        limit = max(self.config.base_rate, 10 * self.config.batch)
        started = time.monotonic() + START_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < max(deadline, started):
            snap = self.local.monitor.snapshot()
            if any(g.gateway_id.startswith(PREFIXES[kind]) for g in snap.lag):
                started = 0.0
                if snap.lag_rows > limit or time.monotonic() >= deadline:
                    break
            await asyncio.sleep(0.25)
        return self._now()

    async def _overload(self) -> None:
        cfg = self.config
        assert self.capacity is not None
        self.pinned = True
        self.local.backend.scale_to(cfg.max_workers)
        target = cfg.overload_factor * self.capacity
        burst_rate = max(target - cfg.base_rate, 1.0)
        phase = self._phase(
            "overload",
            capacity_meas_per_s=round(self.capacity, 1),
            target_meas_per_s=round(target, 1),
            workers=cfg.max_workers,
            scaler=(
                f"lag policy pinned at its maximum ({cfg.max_workers} workers)"
                if cfg.scaler
                else f"no scaler: fixed maximum of {cfg.max_workers} workers"
            ),
        )
        simulator = self._simulator(
            "burst", BURST_SENSORS, burst_rate / (2 * BURST_SENSORS), cfg.overload_s + 20.0
        )
        start = await self._until_backlog("burst", 15.0)
        await asyncio.sleep(cfg.overload_s)
        end = self._now()
        await self._stop(simulator)
        phase.end = self._now()
        self.pinned = False
        burst = _read(self.reports[-1])
        # Offered: what the gateways were given. What they published is less, by design:
        # their end-to-end window keeps the backlog in their spools (docs/guarantees.md).
        offered = cfg.base_rate + float(burst.get("offered_rate") or 0.0)
        published = cfg.base_rate + float(burst.get("achieved_rate") or 0.0)
        applied, _ = self._applied_rate(start, end)
        phase.details.update(
            measured_s=round(end - start, 1),
            offered_meas_per_s=round(offered, 1),
            published_meas_per_s=round(published, 1),
            offered_x_capacity=round(offered / max(self.capacity, 1.0), 2),
            applied_meas_per_s=round(applied, 1),
            live_workers=sorted({s.workers for s in self.samples if start <= s.t <= end}),
            burst_simulator=burst,
        )
        await self._drain("burst")
        # The backlog drains while the run goes on (and faults continue).
        self._background.append(asyncio.create_task(self._watch_drain(phase, end)))

    async def _watch_drain(self, phase: _Phase, since: float) -> None:
        drained = await self._until_drained(3600.0)
        phase.details["peak_lag_measurements"] = max(
            (s.lag_rows for s in self.samples if s.t >= phase.start), default=0
        )
        phase.details["drained_after_s"] = None if drained is None else round(drained - since, 1)

    def _applied_rate(self, start: float, end: float) -> tuple[float, bool]:
        """Measurements applied per second between two run times (combiner 0's clock)."""
        window = [s for s in self.samples if start <= s.t <= end and s.at_ms]
        if len(window) < 2 or window[-1].at_ms <= window[0].at_ms:
            return 0.0, False
        first, last = window[0], window[-1]
        rate = (last.applied - first.applied) / ((last.at_ms - first.at_ms) / 1000.0)
        return rate, last.lag_rows > first.lag_rows

    async def _until_drained(self, timeout_s: float) -> float | None:
        """Wait until the backlog is back to about a second of base load."""
        limit = max(2 * self.config.base_rate, 4 * self.config.batch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = self.local.monitor.snapshot()
            if snap.lag_rows <= limit:
                return self._now()
            await asyncio.sleep(0.5)
        return None

    # -- the end ---------------------------------------------------------------------------------

    async def _settle(self) -> dict[str, Any]:
        cfg = self.config
        ended = self._now()
        for simulator in list(self.local.simulators):
            if simulator.alive():
                await self._stop(simulator)
        await self._drain("base")
        deadline = time.monotonic() + cfg.settle_timeout_s
        while not all(g.wait_confirmed(0) for g in self.drainers):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        confirmed = all(g.wait_confirmed(0) for g in self.drainers)
        async with AsyncSession(self.local.credentials("admin"), unique_client_id("chaos")) as s:
            await s.publish(self.local.topics.combiner_control(self.spec.name), b'{"cmd": "flush"}')
        published = self._published()
        flush_deadline = time.monotonic() + 60
        while time.monotonic() < flush_deadline:
            counted = self.ledger.rows_in_results + self.ledger.late_rows
            if counted >= published["rows_sealed"] and self._applied() >= published["rows_sealed"]:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # a late duplicate would show up now
        return self._record(ended, confirmed=confirmed, published=published)

    def _published(self) -> dict[str, int]:
        totals = {"rows_sealed": 0, "rows_published": 0, "batches_sealed": 0, "resends": 0}
        for path in self.reports:
            report = _read(path)
            if not report:
                raise RuntimeError(f"a simulator wrote no report ({path}); see its log")
            for name in totals:
                totals[name] += int(report.get(name, 0))
        return totals

    def _applied(self) -> int:
        return int(self.local.monitor.snapshot().combiners.get(0, {}).get("batch_rows", 0))

    def _record(
        self, ended: float, *, confirmed: bool, published: dict[str, int]
    ) -> dict[str, Any]:
        cfg = self.config
        snap = self.local.monitor.snapshot()
        sealed = published["rows_sealed"]
        counted = self.ledger.rows_in_results + self.ledger.late_rows
        lost = max(0, sealed - counted)
        duplicated = max(0, counted - sealed) + self.ledger.conflict_rows
        components = self.local.sampler.report()
        peaks = _peaks_by_kind(components)
        bounded = all(peak <= cfg.rss_limit_mb for peak in peaks.values())
        return {
            "benchmark": "chaos",
            "config": {
                **{k: v for k, v in asdict(cfg).items() if k != "run_dir"},
                "base_meas_per_s": cfg.base_rate,
                "pipeline": self.spec.name,
                "partitions": self.spec.partitions,
                "windows": [w.name for w in self.spec.windows],
            },
            "duration_s": round(ended, 1),
            "measurements": {
                "published": sealed,
                "published_to_broker": published["rows_published"],
                "applied": self._applied(),
                "in_results": self.ledger.rows_in_results,
                "late": self.ledger.late_rows,
                "lost": lost,
                "duplicated": duplicated,
                "dead_lettered_messages": self.ledger.deadletters,
            },
            "batches": {
                "sealed": published["batches_sealed"],
                "resends_by_simulators": published["resends"],
                "unconfirmed_at_end": snap.lag_batches,
                "all_confirmed": confirmed,
            },
            "results": {
                "window_messages": len(self.ledger.windows),
                "republished_identical": self.ledger.republished,
                "conflicting_copies": self.ledger.conflicts,
                "corrections": self.ledger.corrections,
                # closes re-taken from the close log by restored combiners (and given up)
                "closes_replayed": sum(
                    int(c.get("closes_replayed", 0)) for c in snap.combiners.values()
                ),
                "replays_abandoned": sum(
                    int(c.get("replays_abandoned", 0)) for c in snap.combiners.values()
                ),
                "late_reports": len(self.ledger.late),
                "unreadable": self.ledger.unreadable,
            },
            "faults": {
                "kills": sum(self.kills.values()),
                "kills_by_kind": dict(self.kills),
                "broker_restarts": self._count("broker_restart"),
                "gateway_restarts": self._count("gateway_restart"),
                "pauses": self._count("pause"),
                "overload_phases": self._count("overload"),
                "capacity_meas_per_s": None if self.capacity is None else round(self.capacity, 1),
                "events": self.events,
                "phases": [asdict(p) for p in self.phases],
            },
            "scaler": self._scaler_summary(),
            "memory": {
                "rss_limit_mb": cfg.rss_limit_mb,
                "bounded": bounded,
                "peak_rss_mb_by_kind": peaks,
            },
            "components": components,
            "timeline": self._timeline(),
            "exact": lost == 0 and duplicated == 0 and confirmed and snap.lag_batches == 0,
            "machine": machine(),
        }

    def _timeline(self) -> list[list[float]]:
        """About one sample a second: [t, applied, combiner clock (s), lag, live workers]."""
        out: list[list[float]] = []
        for sample in self.samples:
            if sample.t > 0 and (not out or sample.t - out[-1][0] >= 1.0):
                out.append(
                    [
                        round(sample.t, 1),
                        sample.applied,
                        round(sample.at_ms / 1000.0, 1),
                        sample.lag_rows,
                        sample.workers,
                    ]
                )
        return out

    def _scaler_summary(self) -> dict[str, Any]:
        stats = self.local.backend.stats
        summary: dict[str, Any] = {
            "backend": "local",
            "policy": "lag" if self.scaler is not None else None,
            "bounds": [self.config.min_workers, self.config.max_workers],
            "workers_started": stats.started,
            "workers_drained": stats.drained,
            "workers_replaced_after_crash": stats.replaced,
        }
        if self.scaler is not None:
            summary["scale_events"] = self.scaler.scale_events
        return summary

    # -- background --------------------------------------------------------------------------

    async def _feed_monitor(self) -> None:
        """The monitor's view (QoS 0, clean session), through broker restarts."""
        monitor = self.local.monitor
        while True:
            session = AsyncSession(self.local.credentials("admin"), unique_client_id("chaos-mon"))
            with contextlib.suppress(Exception):
                async with session:
                    # Results and late rows go to the ledger only: big messages, read once.
                    topics = self.local.topics
                    filters = [
                        topics.gateway_status_all(),
                        topics.confirm_all(),
                        topics.metrics_all(),
                    ]
                    await session.subscribe(filters, qos=0)
                    async for message in session.messages():
                        monitor.on_message(message)
            await asyncio.sleep(0.3)

    async def _housekeeping(self) -> None:
        last_print = 0.0
        while True:
            self.local.sampler.sample()
            if self.broker_down:
                pass
            elif self.scaler is not None and not self.pinned:
                with contextlib.suppress(Exception):
                    self.scaler.tick()
            else:
                self.local.backend.observe()  # replace killed workers
            snap = self.local.monitor.snapshot()
            beat = snap.combiners.get(0, {})
            now = self._now() if self.t0 else 0.0
            self.samples.append(
                _Sample(
                    now,
                    int(beat.get("batch_rows", 0)),
                    int(beat.get("at", 0)),
                    snap.lag_rows,
                    len(self.local.backend.live),
                )
            )
            if self.progress is not None and self.t0 and now - last_print >= 2.0:
                last_print = now
                phase = next((p.kind for p in reversed(self.phases) if p.end is None), "load")
                print(
                    f"  [{now:6.1f} s] {phase:<16} workers {len(self.local.backend.live)}  "
                    f"lag {snap.lag_rows:>10,}  applied {int(beat.get('batch_rows', 0)):>12,}  "
                    f"kills {sum(self.kills.values()):>3}",
                    file=self.progress,
                    flush=True,
                )
            await asyncio.sleep(0.5)

    # -- helpers ---------------------------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def _sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self._now()))

    def _event(self, kind: str, target: str) -> None:
        self.events.append({"t": round(self._now(), 2), "kind": kind, "target": target})
        if self.progress is not None:
            print(f"  [{self._now():6.1f} s] {kind} {target}", file=self.progress, flush=True)

    def _phase(self, kind: str, **details: Any) -> _Phase:
        phase = _Phase(kind, round(self._now(), 2), details=details)
        self.phases.append(phase)
        self._event(kind, str(details.get("target", "")))
        return phase

    def _count(self, kind: str) -> int:
        return sum(1 for p in self.phases if p.kind == kind)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _peaks_by_kind(components: list[dict[str, object]]) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for component in components:
        kind = str(component["name"]).split("-")[0]
        rss = float(component["rss_mb"])  # type: ignore[arg-type]
        peaks[kind] = max(peaks.get(kind, 0.0), rss)
    return peaks


def run_chaos(config: ChaosConfig, progress: TextIO | None = None) -> dict[str, Any]:
    """Run once; returns the JSON record."""
    return ChaosRun(config, progress).run()


def format_record(record: dict[str, Any]) -> str:
    """A human-readable summary."""
    m = record["measurements"]
    f = record["faults"]
    lines = [
        f"chaos: {record['duration_s']} s, {record['config']['base_meas_per_s']:,.0f} meas/s base "
        f"load, {record['config']['partitions']} partitions, workers "
        f"{record['scaler']['bounds'][0]}..{record['scaler']['bounds'][1]}",
        f"  faults    {f['kills']} kills ({f['kills_by_kind']['worker']} workers, "
        f"{f['kills_by_kind']['combiner']} combiners), {f['broker_restarts']} broker restart(s), "
        f"{f['gateway_restarts']} gateway restart(s), {f['pauses']} pause(s), "
        f"{f['overload_phases']} overload phase(s)",
    ]
    for phase in f["phases"]:
        d = phase["details"]
        if phase["kind"] == "capacity_probe":
            lines.append(
                f"  capacity  {d.get('capacity_meas_per_s', 0):,.0f} meas/s at "
                f"{d.get('workers')} workers (saturated: {d.get('saturated')})"
            )
        if phase["kind"] == "overload":
            lines.append(
                f"  overload  offered {d.get('offered_meas_per_s', 0):,.0f} meas/s = "
                f"{d.get('offered_x_capacity')} x capacity "
                f"({phase['end'] - phase['start']:.0f} s phase); published "
                f"{d.get('published_meas_per_s', 0):,.0f}/s (the rest waited in the spools); "
                f"applied {d.get('applied_meas_per_s', 0):,.0f}/s; peak lag "
                f"{d.get('peak_lag_measurements', 0):,}; drained {d.get('drained_after_s')} s "
                f"after; {d.get('scaler')}"
            )
    lines += [
        f"  published {m['published']:,}  applied {m['applied']:,}  in results "
        f"{m['in_results']:,}  late {m['late']:,}  dead-lettered {m['dead_lettered_messages']}",
        f"  lost {m['lost']}  duplicated {m['duplicated']}  "
        f"(windows re-published identically: {record['results']['republished_identical']}, "
        f"conflicting: {record['results']['conflicting_copies']}; "
        f"corrections: {record['results']['corrections']}; closes re-taken after restarts: "
        f"{record['results'].get('closes_replayed', 0)}, replays given up: "
        f"{record['results'].get('replays_abandoned', 0)}); "
        f"{'EXACT' if record['exact'] else 'NOT EXACT'}",
        "  memory    peak RSS MB by kind: "
        + ", ".join(f"{k} {v:.0f}" for k, v in record["memory"]["peak_rss_mb_by_kind"].items())
        + f"  (limit {record['memory']['rss_limit_mb']:.0f}: "
        f"{'bounded' if record['memory']['bounded'] else 'EXCEEDED'})",
    ]
    return "\n".join(lines)
