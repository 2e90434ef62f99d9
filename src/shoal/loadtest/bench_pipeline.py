"""``shoal bench pipeline``: simulator → broker → workers → combiners, measured on this machine.

One run (``run_pipeline``) starts a fresh ``LocalPipeline``, lets the simulator offer a fixed
rate for the duration, and reports what the pipeline achieved, its latencies, every
component's CPU and peak memory, and an exact accounting of measurements (count oracle: every
generated measurement must be applied exactly once; after the run, the combiners close every
window and the rows in results plus late rows must equal the rows generated).

``--max`` steps the offered rate up (geometrically, then by bisection) and reports the highest
rate the pipeline sustained: the simulator kept up, the pipeline applied at least 98 % of what
was offered, lag stayed under two seconds of data, and nothing was lost or duplicated.

Every run seals the simulated gateways' batches so that the achieved rate can be read to
``RESOLUTION`` (``sealing``): out of step, and by age often enough. The record says how
(``sealing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TextIO

import orjson
import polars as pl
import psutil

from shoal.broker.recorder import available as recorder_available
from shoal.broker.session import Session, unique_client_id
from shoal.loadtest.alert_latency import (
    AlertProbe,
    ProbeProcess,
    RecorderProbe,
    alert_after_result,
)
from shoal.loadtest.bench_limit import compute_limit
from shoal.processors.spec import PipelineSpec
from shoal.runtime.local import SIMULATOR_CONFIRM_WAIT_S, LocalPipeline, LocalPipelineConfig
from shoal.scaler.monitor import Snapshot

SUSTAIN_FRACTION: Final = 0.98
MAX_LAG_SECONDS: Final = 2.0
LAG_END_SAMPLES: Final = 3
"""Lag samples the end-of-step criterion takes the median of: the last two once-a-second
samples and the one at the end. One sample of a lag that rises and falls with every window
close (a sliding window's every step) reads its crest or its trough by chance."""
WARMUP_S: Final = 3.0
GATEWAYS: Final = {"A": 1, "B": 10}
"""Simulated gateways per scenario."""
RESOLUTION: Final = 0.005
"""How finely ``achieved`` must be readable, as a share of the offered rate (``sealing``)."""
MIN_BATCH_AGE_MS: Final = 100
"""The shortest batch age ``sealing`` gives the gateways (two simulator ticks)."""


@dataclass(frozen=True, slots=True)
class PipelineBenchConfig:
    """One benchmark run.

    Attributes:
        spec: the pipeline.
        spec_source: how child processes find it.
        scenario: simulator scenario, ``A`` (1 x 1,000 sensors) or ``B`` (10 x 1,000).
        rate: measurements per second per sensor.
        batch: rows per batch.
        encoding: batch encoding.
        workers: worker processes.
        duration_s: how long the simulator offers load (after a warm-up).
        per_key_results: publish per-key retained results too.
        gateway_spool: the simulated gateways' spool, ``memory`` (default: simulated
            gateways stand for separate devices, whose disks are not part of the pipeline
            under test) or ``disk`` (their full cost on this machine).
        max_delay_ms: the gateways seal a partial batch once its oldest row is this old, at
            most (``sealing`` shortens it for short runs).
        full_batches: keep ``max_delay_ms`` as given and the gateways in step (``bench
            matrix``: full batches, as the research's gateways sent), not ``sealing``'s.
        sensors_per_gateway: overrides the scenario's 1,000 sensors per gateway (keys).
        window_kind: the ``--window`` preset the spec was given, for the record.
        attributes: the gateways send the attribute columns even when the pipeline does
            not read them (comparisons on the same input; a pipeline that reads them
            always gets them).
        run_dir: keep the run's logs, spools and checkpoints here (None: a temporary
            folder, removed at the end).
    """

    spec: PipelineSpec
    spec_source: str
    scenario: str = "B"
    rate: float = 25.0
    batch: int = 16_000
    encoding: str = "binary"
    workers: int = 2
    duration_s: float = 30.0
    per_key_results: bool = True
    gateway_spool: str = "memory"
    max_delay_ms: int = 1_000
    full_batches: bool = False
    sensors_per_gateway: int | None = None
    window_kind: str | None = None
    attributes: bool = False
    run_dir: Path | None = None

    @property
    def gateways(self) -> int:
        """Simulated gateways."""
        return GATEWAYS[self.scenario.upper()]

    @property
    def sensors(self) -> int:
        """Sensors (keys) over all gateways."""
        return self.gateways * (self.sensors_per_gateway or 1_000)


def offered_rate(config: PipelineBenchConfig) -> float:
    """Measurements per second the simulator offers."""
    return config.sensors * config.rate


@dataclass(frozen=True, slots=True)
class Sealing:
    """How a run's gateways seal their batches, and how finely that lets ``achieved`` be read.

    ``achieved`` is the growth of the combiner's count of applied measurements between two
    heartbeats, and that count grows by whole batches: a staircase, read at two arbitrary
    points. With the gateways sealing out of step (``shoal simulate --stagger``) a stair is
    one gateway's batch, ``span_ms`` of its data, so either end is off by at most
    ``span / (gateways x duration)`` of the offered rate: ``resolution``. (In lock-step, as
    simulated gateways started together seal, a stair was every gateway's batch at once: at
    1-s batches and 10-s steps, +-10 % at either end, five times what the 98 % criterion
    allows, so low-rate steps passed or failed by chance.)

    Attributes:
        max_delay_ms: the gateways' batch age: the configured one; where batches would
            not fill within it (they are sealed by age), shortened so that ``resolution``
            stays within ``RESOLUTION`` (not below ``MIN_BATCH_AGE_MS``). Batches that fill
            first keep their size: the runs that measure a batch size stay as they were.
        fill_ms: how long a gateway takes to fill a ``batch``-row batch at this rate.
        span_ms: what one batch holds: ``fill_ms`` or ``max_delay_ms``, the shorter.
        sealed_by: ``size`` (batches fill) or ``age`` (``max_delay_ms`` seals them first).
        resolution: the largest error at either end of the measured window, as a share
            of the offered rate.
    """

    max_delay_ms: int
    fill_ms: float
    span_ms: float
    sealed_by: str
    resolution: float
    staggered: bool = True

    def to_dict(self) -> dict[str, Any]:
        """For the record (key ``sealing``)."""
        return asdict(self)


def sealing(config: PipelineBenchConfig) -> Sealing:
    """The batch age for one run and what it gives (``Sealing``)."""
    per_gateway = config.sensors / config.gateways * config.rate
    fill_ms = config.batch / per_gateway * 1000.0
    window_ms = config.gateways * config.duration_s * 1000.0
    max_delay_ms = config.max_delay_ms
    if fill_ms > max_delay_ms and not config.full_batches:  # sealed by age: its age is a stair
        max_delay_ms = min(max_delay_ms, max(MIN_BATCH_AGE_MS, int(RESOLUTION * window_ms)))
    span_ms = min(fill_ms, float(max_delay_ms))
    in_step = config.full_batches and config.gateways > 1  # one stair: every gateway's batch
    return Sealing(
        max_delay_ms=max_delay_ms,
        fill_ms=round(fill_ms, 1),
        span_ms=round(span_ms, 1),
        sealed_by="size" if fill_ms <= max_delay_ms else "age",
        resolution=round(span_ms / (window_ms / config.gateways if in_step else window_ms), 4),
        staggered=not config.full_batches,
    )


def run_pipeline(config: PipelineBenchConfig, progress: TextIO | None = None) -> dict[str, Any]:
    """Run once; returns the JSON record.

    Before the pipeline starts, one core's compute limit for the run's batches is measured
    in this process (``bench_limit``): ``compute_limit_meas_per_s``, and ``efficiency`` =
    achieved / (limit x cores).
    """
    limit = compute_limit(
        config.spec,
        batch=config.batch,
        encoding=config.encoding,
        sensors=config.sensors_per_gateway or 1_000,
        rate_hz=config.rate,
    )
    record = _run_pipeline(config, progress)
    cores = psutil.cpu_count(logical=True) or 1
    record["compute_limit_meas_per_s"] = round(limit, 1)
    record["efficiency"] = round(record["achieved_meas_per_s"] / (limit * cores), 4)
    return record


def _run_pipeline(config: PipelineBenchConfig, progress: TextIO | None) -> dict[str, Any]:
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=config.spec,
            spec_source=config.spec_source,
            workers=config.workers,
            per_key_results=config.per_key_results,
            run_dir=config.run_dir,
        )
    )
    try:
        local.start()
        return asyncio.run(_measure(local, config, progress))
    finally:
        local.stop()


def _alert_probe(probe: AlertProbe, local: LocalPipeline) -> RecorderProbe | ProbeProcess:
    """The subscriber that times alerts: ``mosquitto_sub`` when installed, else paho's."""
    settings = local.credentials("admin")
    client_id = unique_client_id("shoal-bench-alerts")
    if recorder_available() and settings.tls is None:
        return RecorderProbe(probe, settings, client_id, local.run_dir / "alert-probe.txt")
    return ProbeProcess(probe, settings, client_id)


async def _measure(
    local: LocalPipeline, config: PipelineBenchConfig, progress: TextIO | None
) -> dict[str, Any]:
    offered = offered_rate(config)
    seal = sealing(config)
    summary_path = local.run_dir / "simulator.json"
    probe = AlertProbe(config.spec.name, local.topics) if config.spec.alerts else None
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(local.watching())
        probe_kind = None
        if probe is not None:
            probe_process = _alert_probe(probe, local)
            probe_kind = probe_process.kind
            await probe_process.start()
            stack.push_async_callback(probe_process.finish)
        await asyncio.sleep(1.5)
        local.start_simulator(
            [
                "--scenario",
                config.scenario,
                *(
                    []
                    if config.sensors_per_gateway is None
                    else ["--sensors", str(config.sensors_per_gateway)]
                ),
                "--rate",
                str(config.rate),
                "--batch",
                str(config.batch),
                "--encoding",
                config.encoding,
                "--duration",
                str(WARMUP_S + config.duration_s),
                "--spool",
                config.gateway_spool,
                "--max-delay-ms",
                str(seal.max_delay_ms),
                *(["--stagger"] if seal.staggered else []),
                "--spool-dir",
                str(local.run_dir / "spool"),
                "--json",
                str(summary_path),
                "--wait-confirmed",
                str(SIMULATOR_CONFIRM_WAIT_S),
                "--quiet",
                *(["--attributes"] if config.attributes else []),
            ]
        )
        await asyncio.sleep(WARMUP_S)
        await _reset_stats(local, session, config.spec.name)
        start = time.monotonic()
        marks = [_applied_mark(local)]  # the window's first, one a second, its last
        cpu_first = local.sampler.cpu_seconds()
        peaks = StepPeaks()
        while time.monotonic() - start < config.duration_s:
            await asyncio.sleep(1.0)
            marks.append(_applied_mark(local))
            snap = local.monitor.snapshot()
            peaks.see(snap)
            _show(progress, time.monotonic() - start, snap)
            dead = local.dead_children()
            if dead:
                raise RuntimeError(f"components exited: {dead}; logs in {local.logs}")
        elapsed = time.monotonic() - start
        measured = (start, start + elapsed)
        marks.append(_applied_mark(local))
        window_cpu = _window_cpu(cpu_first, local.sampler.cpu_seconds(), elapsed)
        at_end = local.monitor.snapshot()
        handle = _worst(at_end.worker_metrics, "handle_ms")
        publish_to_partial = _worst(at_end.worker_metrics, "publish_to_partial_ms")
        lag_at_end = at_end.lag_rows
        settled_lag = peaks.settled(lag_at_end)
        accounting = await local.settle(
            session, progress=None if progress is None else _drain_progress(progress)
        )
        achieved, achieved_basis = achieved_rate(
            marks[0], marks[-1], accounting.applied, WARMUP_S + elapsed + accounting.waited_s, marks
        )
        combiners = local.monitor.snapshot().combiners
        if handle is None or publish_to_partial is None:
            # No worker heartbeat with batch timings yet when the load stopped (a short run at a
            # low rate on a busy machine): take them from the heartbeats after the drain.
            workers = local.monitor.snapshot().worker_metrics
            handle = handle or _worst(workers, "handle_ms")
            publish_to_partial = publish_to_partial or _worst(workers, "publish_to_partial_ms")
    simulator = _read_json(summary_path)
    alert_latency = (
        None
        if probe is None
        else {
            **alert_after_result(probe.results, probe.alerts, since=measured[0], until=measured[1]),
            "retained_ignored": probe.retained_alerts,
            "probe": probe_kind,
        }
    )
    apply_latency = _worst(combiners, "apply_latency_ms")
    result_latency = _worst(combiners, "result_latency_ms")
    sustained = (
        accounting.exact
        and achieved >= SUSTAIN_FRACTION * offered
        and float(simulator.get("achieved_rate", 0.0)) >= SUSTAIN_FRACTION * offered
        and settled_lag <= MAX_LAG_SECONDS * offered
    )
    return {
        "scenario": config.scenario,
        "sensors": config.sensors,
        "windows": [window.kind for window in config.spec.windows],
        "window_preset": config.window_kind,
        "key_results_every_ms": config.spec.key_results_every_ms,
        "rate_per_sensor": config.rate,
        "batch": config.batch,
        "encoding": config.encoding,
        "workers": config.workers,
        "partitions": config.spec.partitions,
        "gateway_spool": config.gateway_spool,
        "attributes": config.attributes or config.spec.reads_attributes,
        "aggregates": list(config.spec.aggregate_names),
        "duration_s": round(elapsed, 2),
        "offered_meas_per_s": round(offered, 1),
        "simulator_meas_per_s": simulator.get("achieved_rate"),
        "simulator_cpu_percent": simulator.get("cpu_percent"),
        "bytes_per_meas": simulator.get("bytes_per_row"),
        "batches_published": simulator.get("batches_published"),
        "sealing": seal.to_dict(),
        "achieved_meas_per_s": round(achieved, 1),
        "achieved_basis": achieved_basis,
        "achieved_fit": {
            "heartbeats": len({at for at, _ in marks if at > 0}),
            "endpoints_meas_per_s": _rounded(endpoint_rate(marks[0], marks[-1])),
        },
        "generated_measurements": accounting.generated,
        "lost_measurements": accounting.lost,
        "duplicated_measurements": accounting.duplicated,
        "late_measurements": accounting.late,
        "deadletters": accounting.deadletters,
        "unconfirmed_batches": accounting.unconfirmed_batches,
        "unconfirmed_measurements": accounting.unconfirmed_rows,
        "drain_s": accounting.drain_s,
        "settle_waited_s": accounting.waited_s,
        "peak_lag_measurements": peaks.lag_rows,
        # near its cap a combiner refuses partials (docs/guarantees.md, "Bounded memory")
        "peak_state_cells": peaks.state_cells,
        "max_state_cells": peaks.state_cap,
        "lag_at_end_measurements": lag_at_end,
        # what the criterion reads: the median of the step's last LAG_END_SAMPLES samples
        "lag_settled_measurements": settled_lag,
        "sustained": sustained,
        "apply_latency_ms": apply_latency,
        "result_latency_ms": (
            None
            if result_latency is None
            else {k: result_latency[k] for k in ("p50", "p99", "max", "n")}
        ),
        "alert_after_result_ms": alert_latency,
        "worker_handle_ms": handle,
        # gateway seals a batch -> its partials handed to the broker (a request/reply round trip)
        "publish_to_partial_ms": (
            None
            if publish_to_partial is None
            else {k: publish_to_partial[k] for k in ("p50", "p99")}
        ),
        "components": local.sampler.report(),
        "window_components": window_cpu,
        "machine": machine(),
    }


@dataclass(slots=True)
class StepPeaks:
    """The highest lag, and state cells of one combiner partition, seen once a second.

    ``lags``: every lag sample of the step, in order (``settled`` reads its end).
    ``state_cap``: the partitions' cap as their heartbeats state it (the spec's, or the
    default sized from the memory the combiner may use); None: no heartbeat said.
    """

    state_cells: int = 0
    state_cap: int | None = None
    lags: list[int] = field(default_factory=list)

    @property
    def lag_rows(self) -> int:
        """The highest lag of the once-a-second samples."""
        return max(self.lags, default=0)

    def see(self, snap: Snapshot) -> None:
        """Take one once-a-second snapshot of the monitor."""
        self.lags.append(snap.lag_rows)
        cells = (int(body.get("state_rows", 0)) for body in snap.combiners.values())
        self.state_cells = max(self.state_cells, *cells, 0)
        bodies = snap.combiners.values()
        caps = [int(body["max_state_cells"]) for body in bodies if "max_state_cells" in body]
        if caps:
            self.state_cap = min(caps)

    def settled(self, at_end: int) -> int:
        """The lag a step ended with: the median of its last samples, ``at_end`` the last.

        ``LAG_END_SAMPLES`` of them, as Burrow judges a Kafka consumer over a window of offsets
        rather than one: a pipeline whose lag swings with its window closes is judged by its
        level, not by where the last sample fell; a lag that grows to the end still fails
        (its last samples are all high).
        """
        recent = self.lags[max(0, len(self.lags) - LAG_END_SAMPLES + 1) :]
        return int(statistics.median([*recent, at_end]))


def _show(progress: TextIO | None, elapsed_s: float, snap: Snapshot) -> None:
    """A progress line of the measured window."""
    if progress is not None:
        print(
            f"  [{elapsed_s:5.1f} s] out {snap.rows_out_per_s:>12,.0f}/s  "
            f"lag {snap.lag_rows:>10,} meas  workers {len(snap.workers)}",
            file=progress,
            flush=True,
        )


def _drain_progress(out: TextIO) -> Callable[[float, Snapshot], None]:
    """Progress lines while the backlog drains after the load stopped."""

    def show(elapsed_s: float, snap: Snapshot) -> None:
        print(
            f"  [drain {elapsed_s:5.1f} s] out {snap.rows_out_per_s:>12,.0f}/s  "
            f"lag {snap.lag_rows:>10,} meas in {snap.lag_batches:,} batches",
            file=out,
            flush=True,
        )

    return show


async def _reset_stats(local: LocalPipeline, session: Session, pipeline: str) -> None:
    """Combiners and workers forget the warm-up's latencies."""
    reset = orjson.dumps({"cmd": "reset_stats"})
    await session.publish(local.topics.combiner_control(pipeline), reset)
    for worker_id in local.monitor.snapshot().workers:
        await session.publish(local.topics.control(worker_id), reset)


def _window_cpu(
    first: dict[str, float], last: dict[str, float], elapsed_s: float
) -> list[dict[str, Any]]:
    """Per process, CPU used during the measured window only (no start-up, no settling)."""
    return [
        {
            "name": name,
            "cpu_seconds": round(last[name] - first[name], 3),
            "cpu_percent": round(100.0 * (last[name] - first[name]) / max(elapsed_s, 1e-9), 1),
        }
        for name in last
        if name in first
    ]


def _applied_mark(local: LocalPipeline) -> tuple[int, int]:
    """(heartbeat time ms, measurements applied) of combiner partition 0's last heartbeat.

    (0, 0) while no heartbeat has been received.
    """
    beat = local.monitor.snapshot().combiners.get(0, {})
    return int(beat.get("at", 0)), int(beat.get("batch_rows", 0))


HEARTBEATS_BASIS: Final = "combiner heartbeats"


def achieved_rate(
    first: tuple[int, int],
    last: tuple[int, int],
    applied: int,
    run_s: float,
    marks: Sequence[tuple[int, int]] = (),
) -> tuple[float, str]:
    """Measurements applied per second during the window, and what the figure rests on.

    From the combiner's heartbeats (``_applied_mark``, the combiner's own clock): the
    least-squares slope of the applied count over the distinct heartbeats among ``marks``
    (the window's first, one a second, its last) when there are three or more, else the
    difference between ``first`` and ``last`` when they are two different heartbeats. The
    slope reads through what the two ends alone make noisy in a short step: the count grows
    by whole batches (``Sealing``), and a pause of the combiner just before the last
    heartbeat (a tumbling window of 100,000 keys closing) leaves batches in flight at that
    end only (10-s steps at 15,000 meas/s, four runs each: 97.7-100.8 % of offered from the
    ends, 99.3-99.9 % from the slope). Otherwise (under heavy load a busy combiner publishes no
    heartbeat for a while, and they travel at QoS 0: both marks may be the same heartbeat,
    or none was received) the difference would be a silent 0. Then the rate over the whole
    run: every measurement applied over the wall time from the simulators' start to the
    end of settling, a lower bound (it includes the warm-up and the drain); the basis says
    so and why.
    """
    rate = fitted_rate(marks)
    if rate is None:
        rate = endpoint_rate(first, last)
    if rate is not None:
        return rate, HEARTBEATS_BASIS
    why = (
        "no combiner heartbeat received"
        if last[0] == 0
        else "no combiner heartbeat received during the measured window"
    )
    return applied / max(run_s, 1e-9), f"whole run, a lower bound ({why})"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def endpoint_rate(first: tuple[int, int], last: tuple[int, int]) -> float | None:
    """Applied measurements per second between two heartbeats (None: not two of them)."""
    if first[0] > 0 and last[0] > first[0]:
        return (last[1] - first[1]) / ((last[0] - first[0]) / 1000.0)
    return None


def fitted_rate(marks: Sequence[tuple[int, int]]) -> float | None:
    """Least-squares slope of applied measurements per second over distinct heartbeats.

    None with fewer than three (heartbeat time ms, applied) marks from distinct heartbeats.
    """
    points = sorted({at: rows for at, rows in marks if at > 0}.items())
    if len(points) < 3:
        return None
    ts = [at / 1000.0 for at, _ in points]
    ys = [float(rows) for _, rows in points]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    sxx = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / sxx


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _worst(components: dict[Any, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """Per quantile, the worst over partitions (a batch is done when all are) or workers.

    With one component its summary is returned whole (with its ``cdf``).
    """
    summaries = [c[name] for c in components.values() if c.get(name)]
    if not summaries:
        return None
    if len(summaries) == 1:
        return dict(summaries[0])
    return {k: max(s[k] for s in summaries) for k in ("p50", "p95", "p99", "max", "n")}


def machine() -> dict[str, Any]:
    """Facts about this machine, stored with every result."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(logical=True),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "polars": pl.__version__,
        "load_average": [round(x, 2) for x in psutil.getloadavg()],
    }


MAX_STEPS_DOWN: Final = 6
"""``--max`` steps down at most this many times when its first rate is not sustained."""


def run_max(
    config: PipelineBenchConfig,
    progress: TextIO | None = None,
    *,
    factor: float = 1.6,
    refine: int = 2,
    step: Callable[[PipelineBenchConfig, TextIO | None], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Step the offered rate up until a step is not sustained; refine by bisection.

    A first step that is not sustained is run again once; if it fails again the search
    steps down (``MAX_STEPS_DOWN``) until a rate is sustained.
    ``step`` runs one step (default: the whole pipeline at that rate; tests pass a model).
    """
    run_step = step or _step
    steps: list[dict[str, Any]] = []

    def at(rate: float) -> dict[str, Any]:
        record = run_step(replace(config, rate=rate), progress)
        steps.append(record)
        return record

    good, bad_rate = _step_up(at, config.rate, factor)
    if good is None:
        good, bad_rate = _step_down(at, bad_rate, factor)
    if good is None:  # nothing sustained even at the lowest rate tried
        return _max_record(None, steps)
    return _max_record(_bisect(at, good, bad_rate, refine), steps)


_RunAt = Callable[[float], dict[str, Any]]


def _step_up(at: _RunAt, rate: float, factor: float) -> tuple[dict[str, Any] | None, float]:
    """The last sustained step (or None) and the first rate that was not sustained."""
    good: dict[str, Any] | None = None
    first = True
    while True:
        record = at(rate)
        if first and not record["sustained"]:
            # A stall that happened to end a 10-s step (a close of 100,000 keys) would
            # otherwise cap the whole search below its first rate.
            record = at(rate)
        first = False
        if not record["sustained"]:
            return good, rate
        good = record
        rate *= factor


def _step_down(at: _RunAt, bad_rate: float, factor: float) -> tuple[dict[str, Any] | None, float]:
    """Step down from ``bad_rate`` until a rate is sustained, at most ``MAX_STEPS_DOWN`` times.

    A first guess above the maximum still finds it instead of reporting nothing.
    """
    for _ in range(MAX_STEPS_DOWN):
        rate = bad_rate / factor
        record = at(rate)
        if record["sustained"]:
            return record, bad_rate
        bad_rate = rate
    return None, bad_rate


def _bisect(at: _RunAt, good: dict[str, Any], bad_rate: float, refine: int) -> dict[str, Any]:
    """The highest sustained step after ``refine`` bisections of (good, bad_rate)."""
    low = good["rate_per_sensor"]
    for _ in range(refine):
        if bad_rate - low < 0.05 * bad_rate:
            break
        middle = (low + bad_rate) / 2
        record = at(middle)
        if record["sustained"]:
            good, low = record, middle
        else:
            bad_rate = middle
    return good


def _max_record(good: dict[str, Any] | None, steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "max_sustained_meas_per_s": good["achieved_meas_per_s"] if good else 0.0,
        "max_sustained_offered_meas_per_s": good["offered_meas_per_s"] if good else 0.0,
        "best": good,
        "steps": steps,
        "machine": machine(),
    }


def _step(config: PipelineBenchConfig, progress: TextIO | None) -> dict[str, Any]:
    if progress is not None:
        seal = sealing(config)
        print(
            f"step: offering {offered_rate(config):,.0f} meas/s "
            f"({config.scenario}, {config.rate:g}/s per sensor, batch {config.batch} sealed by "
            f"{seal.sealed_by} within {seal.span_ms:,.0f} ms, {config.encoding}, "
            f"{config.workers} workers)",
            file=progress,
            flush=True,
        )
    record = run_pipeline(config, progress)
    if progress is not None:
        print(
            f"  -> achieved {record['achieved_meas_per_s']:,.0f}/s, lost "
            f"{record['lost_measurements']}, duplicated {record['duplicated_measurements']}, "
            f"{'sustained' if record['sustained'] else 'NOT sustained'}",
            file=progress,
            flush=True,
        )
    return record


def _basis_note(record: dict[str, Any]) -> str:
    basis = record.get("achieved_basis", HEARTBEATS_BASIS)
    return "" if basis == HEARTBEATS_BASIS else f" [{basis}]"


def format_record(record: dict[str, Any]) -> str:
    """A human-readable block for one run."""
    share = record["achieved_meas_per_s"] / max(record["offered_meas_per_s"], 1)
    lines = [
        f"pipeline: scenario {record['scenario']} ({record['sensors']:,} keys, "
        f"{'/'.join(record['windows'])} windows), {record['rate_per_sensor']:g}/s per sensor, "
        f"batch {record['batch']}, {record['encoding']}, {record['workers']} workers, "
        f"{record['partitions']} partition(s), {record['duration_s']} s, "
        f"gateway spool {record['gateway_spool']}",
        f"  offered   {record['offered_meas_per_s']:>14,.0f} meas/s"
        f"   (simulator {record['simulator_meas_per_s'] or 0:,.0f}/s)",
        f"  achieved  {record['achieved_meas_per_s']:>14,.0f} meas/s   ({share:.1%} of offered)"
        + _basis_note(record),
        *sealing_lines(record.get("sealing")),
        f"  generated {record['generated_measurements']:,}; lost {record['lost_measurements']}, "
        f"duplicated {record['duplicated_measurements']}, late {record['late_measurements']}; "
        f"peak lag {record['peak_lag_measurements']:,} meas; "
        f"{'sustained' if record['sustained'] else 'NOT sustained'}",
        f"  {settle_text(record)}",
    ]
    if record.get("max_state_cells"):
        lines.append(
            f"  state     peak {record['peak_state_cells']:,} cells in a combiner partition "
            f"(cap max_state_cells {record['max_state_cells']:,})"
        )
    handle, to_partial = record.get("worker_handle_ms"), record.get("publish_to_partial_ms")
    if handle:
        lines.append(
            f"  worker batch handling      p50 {handle['p50']:.2f} ms  p99 {handle['p99']:.2f} ms"
        )
    if to_partial:
        lines.append(
            f"  publish -> partials out    p50 {to_partial['p50']:.1f} ms  "
            f"p99 {to_partial['p99']:.1f} ms"
        )
    if record.get("compute_limit_meas_per_s"):
        lines.append(
            f"  compute limit {record['compute_limit_meas_per_s']:,.0f} meas/s per core "
            f"(decode + partials, no I/O); efficiency {record['efficiency']:.1%} "
            "(achieved / (limit x cores))"
        )
    apply = record["apply_latency_ms"]
    if apply:
        lines.append(
            f"  publish -> batch applied   p50 {apply['p50']:.1f} ms  p95 {apply['p95']:.1f} ms  "
            f"p99 {apply['p99']:.1f} ms  (n={apply['n']})"
        )
    result = record["result_latency_ms"]
    if result:
        lines.append(
            f"  window close -> result     p50 {result['p50']:.1f} ms  p99 {result['p99']:.1f} ms"
            f"  (n={result['n']})"
        )
    lines.extend(alert_lines(record.get("alert_after_result_ms")))
    lines.append("  component          CPU %   peak RSS MB")
    lines.extend(
        f"  {c['name']:<16} {c['cpu_percent']:>7.1f}   {c['rss_mb']:>10.1f}"
        for c in record["components"]
    )
    return "\n".join(lines)


def sealing_lines(seal: dict[str, Any] | None) -> list[str]:
    """How the gateways sealed, and how finely ``achieved`` reads (none in older records)."""
    if not seal:
        return []
    how = (
        f"every {seal['span_ms']:,.0f} ms by size"
        if seal["sealed_by"] == "size"
        else f"by age every {seal['max_delay_ms']:,} ms (filling a batch takes "
        f"{seal['fill_ms']:,.0f} ms)"
    )
    return [
        f"  batches   sealed {how}, gateways {'out of' if seal['staggered'] else 'in'} step: "
        "achieved read to "
        f"+-{seal['resolution']:.1%} at either end"
    ]


def alert_lines(alerts: dict[str, Any] | None) -> list[str]:
    """The alert latency lines of a record (none for a pipeline without alerts)."""
    if alerts is None:
        return []
    lines = []
    subscriber = f"at {alerts['probe']}" if alerts.get("probe") else "at the subscriber"
    for name, label in (("received", subscriber), ("emitted", "combiner clock")):
        figure = alerts.get(name)
        if figure:
            lines.append(
                f"  result -> alert ({label:<17}) p50 {figure['p50']:.1f} ms  "
                f"p99 {figure['p99']:.1f} ms  max {figure['max']:.1f} ms  (n={figure['count']})"
            )
    states = alerts.get("transitions", {})
    lines.append(
        f"  alert transitions: {states.get('firing', 0):,} firing, "
        f"{states.get('resolved', 0):,} resolved; {alerts.get('outside_window', 0):,} outside "
        f"the measured window, {alerts.get('unmatched', 0):,} without their result"
    )
    return lines


def settle_text(record: dict[str, Any]) -> str:
    """What happened after the load stopped: drained, or what is still unconfirmed."""
    waited = record.get("settle_waited_s") or 0.0
    if not record.get("unconfirmed_batches"):
        return f"backlog drained {waited:.1f} s after the load stopped"
    return unconfirmed_text(record) + "; not counted as lost"


def unconfirmed_text(record: dict[str, Any]) -> str:
    """``unconfirmed N batches (...)`` of a run record ("" when every batch was confirmed)."""
    if not record.get("unconfirmed_batches"):
        return ""
    return (
        f"unconfirmed {record['unconfirmed_batches']:,} batches "
        f"({record.get('unconfirmed_measurements', 0):,} meas, still spooled at the gateways) "
        f"after waiting {record.get('settle_waited_s') or 0.0:.1f} s"
    )


def dumps(data: dict[str, Any]) -> str:
    """JSON for files."""
    return json.dumps(data, indent=2)
