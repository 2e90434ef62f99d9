"""``shoal bench scaling``: scaling policies driven through the real pipeline by a load trace.

For each policy, a fresh ``LocalPipeline`` (embedded broker, combiners, workers under the
local backend) is started with the minimum number of workers; simulated gateways follow the
trace (``shoal.runtime.loadtrace``: scenario A, then B, then A again for ``step``), and the
scaler ticks once a second with that policy. Every tick is recorded: gateways, workers (live
and desired), lag in measurements and in seconds of data, the oldest unconfirmed batch.
At the end the run is settled (every batch confirmed, every window closed) and accounted
exactly: measurements lost and duplicated must both be zero.

Per policy it reports: max lag (measurements, seconds of data), the time from each rise of
the load until lag stays below one second of data, p99 apply latency (gateway ``sent_at``
to batch applied, from the combiner), scale events (per change of the trace), worker-seconds
used, and the accounting. With several policies, they run one after another on the same
trace and a comparison table follows.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import orjson

from shoal.processors.spec import PipelineSpec
from shoal.runtime.loadtrace import GatewayLoad, Trace, TraceDriver
from shoal.runtime.local import Accounting, LocalPipeline, LocalPipelineConfig
from shoal.runtime.scaler import Scaler, ScalerConfig
from shoal.scaler.policy import Bounds

LAG_TARGET_S: Final = 1.0
"""Lag counts as recovered once it is below this many seconds of data ..."""
HOLD_S: Final = 5.0
"""... for this long."""
STARTUP_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class ScalingBenchConfig:
    """One invocation of the scaling benchmark.

    Attributes:
        spec: the pipeline.
        spec_source: how child processes find it.
        trace: the load trace.
        load: what each simulated gateway sends.
        policies: policies to run, one after another.
        bounds: worker limits (the same for every policy).
        interval_s: seconds between scaler ticks (and samples).
        run_dir: keep logs here (None: temporary folders, removed).
    """

    spec: PipelineSpec
    spec_source: str
    trace: Trace
    load: GatewayLoad = field(default_factory=GatewayLoad)
    policies: tuple[str, ...] = ("lag",)
    bounds: Bounds = field(default_factory=lambda: Bounds(1, 8))
    interval_s: float = 1.0
    run_dir: Path | None = None

    def offered_at(self, t_s: float) -> float:
        """Measurements per second the trace offers at ``t_s``."""
        gateways = self.trace.phase_at(t_s).gateways
        return gateways * self.load.sensors * self.load.rate


@dataclass(frozen=True, slots=True)
class Sample:
    """One tick of a run."""

    t_s: float
    phase: str
    gateways: int
    offered_per_s: float
    arrival_per_s: float
    workers: int
    desired: int
    lag_rows: int
    lag_s: float
    oldest_s: float | None
    worker_cpu_max: float
    reason: str


@dataclass
class PolicyRun:
    """What one policy did over the trace."""

    policy: str
    samples: list[Sample]
    scale_events: list[float]
    worker_seconds: float
    accounting: Accounting  # where every generated measurement went
    apply_p99_ms: float | None
    apply_p50_ms: float | None
    workers_started: int
    workers_crashed: int
    wall_s: float
    error: str | None = None

    @property
    def max_lag_rows(self) -> int:
        """Largest lag seen, in measurements."""
        return max((s.lag_rows for s in self.samples), default=0)

    @property
    def max_lag_s(self) -> float:
        """Largest lag seen, in seconds of data at the offered rate."""
        return max((s.lag_s for s in self.samples), default=0.0)

    @property
    def peak_workers(self) -> int:
        """Most live workers at once."""
        return max((s.workers for s in self.samples), default=0)


def recovery_times(
    run: PolicyRun, trace: Trace, target_s: float = LAG_TARGET_S, hold_s: float = HOLD_S
) -> list[float | None]:
    """For every rise of the load: seconds until lag is below ``target_s`` for good.

    Lag builds up over the first seconds after a rise, so "below the target for ``hold_s``"
    right at the rise says nothing: what counts is the last tick at or above the target before
    the next change of the trace. The recovery is the time from the rise to the first tick after
    it, provided lag then stays below the target for at least ``hold_s``. 0 when lag never
    reached the target; None when it did not settle before the next change of the trace.
    """
    out: list[float | None] = []
    for rise, window in _rise_windows(run, trace):
        above = [s.t_s for s in window if s.lag_s >= target_s]
        if not above:
            out.append(0.0)
            continue
        after = [s.t_s for s in window if s.t_s > above[-1]]
        settled = bool(after) and after[-1] - after[0] >= hold_s
        out.append(round(after[0] - rise, 1) if settled else None)
    return out


def ticks_above_target(run: PolicyRun, trace: Trace, target_s: float = LAG_TARGET_S) -> int:
    """Ticks with lag at or above ``target_s`` in the phases that begin with a rise of load."""
    return sum(1 for _, window in _rise_windows(run, trace) for s in window if s.lag_s >= target_s)


def _rise_windows(run: PolicyRun, trace: Trace) -> list[tuple[float, list[Sample]]]:
    """(rise, samples from the rise to the next change of the trace), for every rise."""
    bounds = [p.at_s for p in trace.phases] + [trace.duration_s]
    out = []
    for rise in trace.steps_up():
        end = min(b for b in bounds if b > rise)
        out.append((rise, [s for s in run.samples if rise <= s.t_s < end]))
    return out


def events_per_change(run: PolicyRun, trace: Trace) -> list[int]:
    """Scale events between each change of the trace and the next (the first phase included)."""
    starts = [p.at_s for p in trace.phases]
    ends = [*starts[1:], float("inf")]
    return [
        sum(1 for e in run.scale_events if a <= e < b) for a, b in zip(starts, ends, strict=True)
    ]


def run_policy(config: ScalingBenchConfig, policy: str, out: TextIO) -> PolicyRun:
    """Run the trace once with ``policy``."""
    run_dir = None if config.run_dir is None else config.run_dir / policy
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=config.spec,
            spec_source=config.spec_source,
            workers=config.bounds.min_workers or 1,
            run_dir=run_dir,
        )
    )
    started = time.monotonic()
    try:
        local.start()
        return asyncio.run(_drive(config, policy, local, out, started))
    finally:
        local.stop()


async def _drive(
    config: ScalingBenchConfig, policy: str, local: LocalPipeline, out: TextIO, started: float
) -> PolicyRun:
    trace = config.trace
    async with local.watching() as session:
        if not await local.until(lambda s: len(s.workers) >= 1, STARTUP_TIMEOUT_S):
            raise RuntimeError(f"no worker came up within {STARTUP_TIMEOUT_S:.0f} s")
        scaler = Scaler(
            ScalerConfig(
                spec=config.spec,
                broker=local.broker.settings,
                topics=local.topics,
                policy=policy,
                bounds=config.bounds,
                interval_s=config.interval_s,
                http_port=None,
            ),
            local.backend,
            monitor=local.monitor,
        )
        driver = TraceDriver(local, trace, config.load)
        samples: list[Sample] = []
        events: list[float] = []
        t0 = time.monotonic()
        next_tick = t0
        next_report = t0
        while (t := time.monotonic() - t0) < trace.duration_s:
            phase = trace.phase_at(t)
            gateways = driver.update(t)
            before = len(local.backend.live)
            record = scaler.tick()
            if record.decision.desired != before:
                events.append(t)
            sig = record.signals
            offered = config.offered_at(t)
            snap = local.monitor.snapshot()
            samples.append(
                Sample(
                    t_s=round(t, 2),
                    phase=phase.label,
                    gateways=gateways,
                    offered_per_s=offered,
                    arrival_per_s=round(sig.arrival_rows_per_s, 1),
                    workers=sig.workers,
                    desired=record.decision.desired,
                    lag_rows=sig.backlog_rows,
                    # Seconds of data: at the rate the lag was produced (the measured rate
                    # trails a fall of the load; the offered one leads a rise).
                    lag_s=round(sig.backlog_rows / max(offered, sig.arrival_rows_per_s, 1.0), 3),
                    oldest_s=None
                    if snap.oldest_unconfirmed_age_ms is None
                    else snap.oldest_unconfirmed_age_ms / 1000.0,
                    worker_cpu_max=max(sig.worker_cpu_percent, default=0.0),
                    reason=record.decision.reason,
                )
            )
            if time.monotonic() >= next_report:
                next_report += 5.0
                s = samples[-1]
                print(
                    f"  [{policy} {t:5.0f}/{trace.duration_s:.0f} s] phase {s.phase:4} "
                    f"gateways {s.gateways:2}  workers {s.workers} (want {s.desired})  "
                    f"lag {s.lag_rows:>9,} meas = {s.lag_s:5.2f} s  "
                    f"in {s.arrival_per_s:>9,.0f}/s  cpu max {s.worker_cpu_max:3.0f}%",
                    file=out,
                    flush=True,
                )
            next_tick += config.interval_s
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
        print(
            f"  [{policy}] trace done; settling (every batch confirmed, windows closed)", file=out
        )
        accounting = await local.settle(session)
        snap = local.monitor.snapshot()
    local.backend.observe()
    stats = local.backend.stats
    apply = (snap.combiners.get(0) or {}).get("apply_latency_ms") or {}
    return PolicyRun(
        policy=policy,
        samples=samples,
        scale_events=events,
        worker_seconds=round(stats.worker_seconds, 1),
        accounting=accounting,
        apply_p99_ms=apply.get("p99"),
        apply_p50_ms=apply.get("p50"),
        workers_started=stats.started,
        workers_crashed=stats.crashed,
        wall_s=round(time.monotonic() - started, 1),
    )


def run(config: ScalingBenchConfig, out: TextIO) -> list[PolicyRun]:
    """Every policy of the config, one after another, on the same trace."""
    runs = []
    for i, policy in enumerate(config.policies):
        if i:
            time.sleep(3.0)  # let the previous run's processes and sockets go
        print(f"policy {policy}: {describe_trace(config)}", file=out, flush=True)
        runs.append(run_policy(config, policy, out))
    return runs


def describe_trace(config: ScalingBenchConfig) -> str:
    """One line: the trace's phases and load."""
    load = config.load
    phases = ", ".join(
        f"{p.label} ({p.gateways} gw) at {p.at_s:.0f} s" for p in config.trace.phases
    )
    return (
        f"trace {config.trace.name} over {config.trace.duration_s:.0f} s: {phases}; "
        f"{load.sensors:,} sensors per gateway at {load.rate:g}/s, batches of {load.batch:,} "
        f"({load.encoding}); pipeline {config.spec.name}; workers "
        f"{config.bounds.min_workers}..{config.bounds.max_workers}"
    )


def summarise(run: PolicyRun, trace: Trace) -> dict[str, Any]:
    """The figures of one run (what the table and the JSON show)."""
    return {
        "policy": run.policy,
        "max_lag_measurements": run.max_lag_rows,
        "max_lag_seconds": run.max_lag_s,
        "recovery_s": recovery_times(run, trace),
        "ticks_above_target": ticks_above_target(run, trace),
        "scale_events": len(run.scale_events),
        "scale_events_per_change": events_per_change(run, trace),
        "worker_seconds": run.worker_seconds,
        "peak_workers": run.peak_workers,
        "apply_p50_ms": run.apply_p50_ms,
        "apply_p99_ms": run.apply_p99_ms,
        "generated": run.accounting.generated,
        "applied": run.accounting.applied,
        "lost": run.accounting.lost,
        "duplicated": run.accounting.duplicated,
        "late": run.accounting.late,
        "deadletters": run.accounting.deadletters,
        "unconfirmed_batches": run.accounting.unconfirmed_batches,
        "workers_started": run.workers_started,
        "workers_crashed": run.workers_crashed,
        "wall_s": run.wall_s,
    }


def verdicts(runs: list[PolicyRun], trace: Trace) -> list[tuple[str, bool]]:
    """How the lag policy compares with the others (what the issue asks of it)."""
    by = {r.policy: r for r in runs}
    lag = by.get("lag")
    if lag is None:
        return []
    recover = recovery_times(lag, trace)
    per_change = events_per_change(lag, trace)[1:]
    out = [
        (
            f"lag policy: lag below {LAG_TARGET_S:g} s of data (for {HOLD_S:g} s) within 10 s "
            "of every rise",
            all(r is not None and r <= 10.0 for r in recover),
        ),
        (
            "lag policy: at most 2 scale events per change of the load",
            max(per_change, default=0) <= 2,
        ),
        (
            "lag policy: zero loss and zero duplicates",
            lag.accounting.lost == 0 and lag.accounting.duplicated == 0,
        ),
    ]
    others = [r for r in runs if r.policy != "lag"]
    if others:
        names = " and ".join(r.policy for r in others)
        out.append(
            (
                f"lag policy: fewer worker-seconds than {names}",
                all(lag.worker_seconds < r.worker_seconds for r in others),
            )
        )
        out.append(
            (
                f"lag policy: lower max lag than {names}",
                all(lag.max_lag_rows < r.max_lag_rows for r in others),
            )
        )
    return out


def format_table(runs: list[PolicyRun], trace: Trace) -> str:
    """The comparison table."""
    header = (
        f"{'policy':6} {'max lag meas':>13} {'max lag s':>9} {'recovery s':>11} "
        f"{'events':>7} {'per change':>11} {'worker-s':>9} {'peak':>5} {'apply p99 ms':>13} "
        f"{'lost':>5} {'dup':>4}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        s = summarise(r, trace)
        recovery = ",".join("never" if x is None else f"{x:g}" for x in s["recovery_s"]) or "-"
        p99 = "-" if s["apply_p99_ms"] is None else f"{s['apply_p99_ms']:,.1f}"
        lines.append(
            f"{r.policy:6} {s['max_lag_measurements']:>13,} {s['max_lag_seconds']:>9.2f} "
            f"{recovery:>11} {s['scale_events']:>7} "
            f"{','.join(map(str, s['scale_events_per_change'])):>11} "
            f"{s['worker_seconds']:>9.0f} {s['peak_workers']:>5} {p99:>13} "
            f"{s['lost']:>5} {s['duplicated']:>4}"
        )
    checks = verdicts(runs, trace)
    if checks:
        lines.append("")
        lines.extend(f"  [{'yes' if ok else 'NO '}] {text}" for text, ok in checks)
    return "\n".join(lines)


def to_json(config: ScalingBenchConfig, runs: list[PolicyRun]) -> bytes:
    """Everything: config, per-policy figures and their samples."""
    trace = config.trace
    record = {
        "benchmark": "scaling",
        "trace": {
            "name": trace.name,
            "duration_s": trace.duration_s,
            "phases": [asdict(p) for p in trace.phases],
        },
        "load": asdict(config.load),
        "pipeline": config.spec.name,
        "bounds": asdict(config.bounds),
        "interval_s": config.interval_s,
        "policies": [
            {**summarise(r, trace), "samples": [asdict(s) for s in r.samples]} for r in runs
        ],
        "verdicts": [{"check": text, "ok": ok} for text, ok in verdicts(runs, trace)],
    }
    return orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n"


def plot(runs: list[PolicyRun], trace: Trace, path: Path) -> None:
    """Workers and lag over time, one column per policy (PNG)."""
    import matplotlib as mpl  # noqa: PLC0415 - optional, only for --plot

    mpl.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    fig, axes = plt.subplots(
        2, len(runs), figsize=(5 * len(runs), 6), sharex=True, sharey="row", squeeze=False
    )
    highest_lag = max((s.lag_s for r in runs for s in r.samples), default=0.0)
    for col, r in enumerate(runs):
        t = [s.t_s for s in r.samples]
        top, bottom = axes[0][col], axes[1][col]
        top.step(t, [s.workers for s in r.samples], where="post", label="workers")
        top.step(t, [s.gateways for s in r.samples], where="post", label="gateways", alpha=0.5)
        top.set_title(f"policy {r.policy}")
        top.set_ylabel("count")
        top.legend(loc="upper right")
        bottom.plot(t, [s.lag_s for s in r.samples], label="lag (s of data)")
        bottom.axhline(LAG_TARGET_S, color="grey", linestyle=":", linewidth=1)
        bottom.set_yscale("symlog", linthresh=1.0)
        bottom.set_ylim(0.0, max(2.0 * highest_lag, 2.0 * LAG_TARGET_S))
        bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        bottom.set_ylabel("lag, seconds of data")
        bottom.set_xlabel("seconds into the trace")
        for phase in trace.phases[1:]:
            for ax in (top, bottom):
                ax.axvline(phase.at_s, color="grey", linewidth=0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
