"""``shoal bench matrix``: the research's experiments, shoal and its baseline side by side.

One invocation runs, on this machine:

1. **the grid**: scenarios A (1 gateway x 1,000 sensors) and B (10 x 1,000) at rates per
   sensor and batch sizes of the research, each cell once for the Flask/pandas baseline (one
   Waitress thread) and once per shoal variant (encoding, pipeline spec; one worker);
2. **the highest sustained rate** of each system with one instance (one Waitress thread /
   one worker) and with the whole machine (one server process / worker per core), stepping
   the offered rate up and down (``search_max``);
3. **the encoding study** (``bench_encoding_study``).

Analogues of the research's metrics (docs/benchmarks.md says more): t_ex is the time to
process one batch (baseline: the request handler; shoal: the worker's decode + partials +
publish); t_rr is the time until the batch's result is in hand (baseline: request sent →
reply read; shoal: gateway seal → batch applied by the combiner). CPU and memory count the
system under test only (baseline: the Waitress processes; shoal: broker + workers +
combiners), never the load generators.

Composition root: imported by the CLI and tests only. ``run`` returns plain data;
``report`` turns it into Markdown; plots are ``bench_plots``'s business.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final, TextIO

from shoal.loadtest import bench_encoding_study
from shoal.loadtest.baseline.bench import BaselineBenchConfig, run_baseline
from shoal.loadtest.bench_encodings import machine as machine_facts
from shoal.loadtest.bench_pipeline import (
    MAX_LAG_SECONDS,
    SUSTAIN_FRACTION,
    PipelineBenchConfig,
    run_pipeline,
    unconfirmed_text,
)
from shoal.processors.spec import PipelineSpec

EQUIVALENT: Final = "baseline-equivalent"
"""The pipeline spec that computes what the baseline computes (count/mean/min/max)."""
SENSORS_PER_GATEWAY: Final = 1_000
SHOAL_SUT: Final = ("broker", "worker", "combiner")
BASELINE_SUT: Final = ("baseline",)
TARGET_CELL: Final = ("A", 25.0, 4_000)
"""Where the latency target is judged: scenario A, 25/s per sensor, batches of 4,000."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of the grid."""

    scenario: str
    rate: float
    batch: int

    @property
    def gateways(self) -> int:
        """Gateways in the scenario."""
        return {"A": 1, "B": 10}[self.scenario]

    @property
    def fill_s(self) -> float:
        """Seconds a gateway takes to fill one batch."""
        return self.batch / (SENSORS_PER_GATEWAY * self.rate)


@dataclass(frozen=True, slots=True)
class Variant:
    """How shoal runs a cell: encoding and pipeline spec."""

    encoding: str = "binary-columnar"
    pipeline: str = EQUIVALENT

    @property
    def label(self) -> str:
        """``binary-columnar`` or ``binary-columnar, default spec``."""
        return self.encoding if self.pipeline == EQUIVALENT else f"{self.encoding}, {self.pipeline}"


@dataclass(frozen=True, slots=True)
class MaxPlan:
    """Where and how to look for the highest sustained rates.

    Attributes:
        scenario: gateways and sensors (the rate per sensor is what varies).
        batch: rows per batch.
        shoal_start_rate: first rate per sensor tried for shoal.
        baseline_start_rate: first rate per sensor tried for the baseline.
        factor: step up (or down) by this until a step fails (or holds).
        max_steps: runs per search.
        duration_s: measured seconds per step.
    """

    scenario: str = "B"
    batch: int = 16_000
    shoal_start_rate: float = 25.0
    baseline_start_rate: float = 8.0
    factor: float = 2.0
    max_steps: int = 5
    duration_s: float = 10.0


@dataclass(frozen=True, slots=True)
class MatrixPlan:
    """Everything one invocation runs."""

    name: str
    cells: tuple[Cell, ...]
    variants: tuple[Variant, ...]
    extra: tuple[tuple[Cell, Variant], ...] = ()
    """Additional shoal runs at single cells (the default spec, other encodings)."""
    duration_s: float = 20.0
    warmup_s: float = 3.0
    max_search: MaxPlan | None = field(default_factory=MaxPlan)
    target_duration_s: float = 20.0
    """Measured seconds at ``TARGET_CELL`` (its p99 needs a hundred batches or more)."""
    study_rows: int = 16_000
    study_repeats: int = 5
    machine_cores: int = field(default_factory=lambda: os.cpu_count() or 1)

    def runs(self) -> list[tuple[Cell, Variant | None]]:
        """(cell, shoal variant or None for the baseline), in the order they run."""
        out: list[tuple[Cell, Variant | None]] = []
        for cell in self.cells:
            out.append((cell, None))
            out.extend((cell, v) for v in self.variants)
            out.extend((c, v) for c, v in self.extra if c == cell)
        return out

    def duration_for(self, cell: Cell) -> float:
        """Measured seconds at ``cell``: at least five batches per gateway."""
        floor = self.target_duration_s if cell == Cell(*TARGET_CELL) else self.duration_s
        return max(floor, 5.0 * cell.fill_s)


def full_plan() -> MatrixPlan:
    """The research's whole grid: A and B x 4, 12, 25 per sensor x 4 batch sizes, 4 encodings."""
    cells = tuple(
        Cell(s, r, b)
        for s in ("A", "B")
        for r in (4.0, 12.0, 25.0)
        for b in (4_000, 16_000, 32_000, 64_000)
    )
    variants = tuple(
        Variant(e) for e in ("binary-columnar", "msgpack-columnar", "msgpack-rows", "json-rows")
    )
    defaults = tuple((Cell(*TARGET_CELL), Variant(pipeline=p)) for p in ("default",))
    return MatrixPlan("full", cells, variants, defaults)


def quick_plan() -> MatrixPlan:
    """A subset for CI-sized runs (under 10 minutes on 2 cores)."""
    cells = (
        Cell("A", 25.0, 4_000),
        Cell("A", 25.0, 16_000),
        Cell("A", 25.0, 64_000),
        Cell("B", 12.0, 16_000),
    )
    extra = (
        (Cell("A", 25.0, 4_000), Variant(pipeline="default")),
        (Cell("A", 25.0, 16_000), Variant("json-rows")),
    )
    return MatrixPlan(
        "quick",
        cells,
        (Variant(),),
        extra,
        duration_s=8.0,
        warmup_s=3.0,
        # shoal starts at 4 M meas/s (400/s x 10,000 sensors): from 1 M its five steps were all
        # spent doubling (100 -> 1,600, 8.05 M sustained, docs/bench/s12-matrix-quick.md) and
        # none was left to bisect; a slower machine halves down from here instead.
        max_search=MaxPlan(
            shoal_start_rate=400.0, baseline_start_rate=16.0, max_steps=5, duration_s=8.0
        ),
        study_repeats=3,
    )


def smoke_plan() -> MatrixPlan:
    """Tiny rates, seconds: the code path only (tests)."""
    return MatrixPlan(
        "smoke",
        (Cell("A", 2.0, 1_000),),
        (Variant(),),
        duration_s=2.0,
        warmup_s=1.0,
        max_search=MaxPlan(
            scenario="A",
            batch=1_000,
            shoal_start_rate=2.0,
            baseline_start_rate=2.0,
            max_steps=1,
            duration_s=2.0,
        ),
        target_duration_s=2.0,
        study_rows=1_000,
        study_repeats=1,
    )


SpecLoader = Callable[[str], PipelineSpec]


@dataclass
class _Runner:
    plan: MatrixPlan
    load_spec: SpecLoader
    progress: TextIO | None
    started: float = field(default_factory=time.monotonic)

    def say(self, text: str) -> None:
        if self.progress is not None:
            elapsed = time.monotonic() - self.started
            print(f"[matrix {elapsed:6.0f} s] {text}", file=self.progress, flush=True)

    def baseline(
        self, cell: Cell, *, instances: int = 1, duration_s: float | None = None
    ) -> dict[str, Any]:
        config = BaselineBenchConfig(
            scenario=cell.scenario,
            rate=cell.rate,
            batch=cell.batch,
            duration_s=duration_s or self.plan.duration_for(cell),
            warmup_s=self.plan.warmup_s,
            instances=instances,
            max_delay_ms=_max_delay_ms(cell),
        )
        return summarise(run_baseline(config, None))

    def shoal(
        self, cell: Cell, variant: Variant, *, workers: int = 1, duration_s: float | None = None
    ) -> dict[str, Any]:
        config = PipelineBenchConfig(
            spec=self.load_spec(variant.pipeline),
            spec_source=variant.pipeline,
            scenario=cell.scenario,
            rate=cell.rate,
            batch=cell.batch,
            encoding=variant.encoding,
            workers=workers,
            duration_s=duration_s or self.plan.duration_for(cell),
            # The baseline returns per-sensor statistics to the gateway; shoal's window
            # message carries every sensor's. Per-key retained topics are extra work that the
            # default spec's runs keep.
            per_key_results=variant.pipeline != EQUIVALENT,
            max_delay_ms=_max_delay_ms(cell),
            full_batches=True,
        )
        return summarise(run_pipeline(config, None))


def _max_delay_ms(cell: Cell) -> int:
    """Long enough that gateways send full batches (the research's gateways did)."""
    return max(1_000, math.ceil(1_250 * cell.fill_s))


def run(plan: MatrixPlan, load_spec: SpecLoader, progress: TextIO | None = None) -> dict[str, Any]:
    """Run ``plan``; returns the JSON document (see docs/benchmarks.md for its fields)."""
    runner = _Runner(plan, load_spec, progress)
    cells = _run_grid(runner)
    searches = _run_searches(runner) if plan.max_search is not None else {}
    runner.say("encoding study")
    study = bench_encoding_study.run(load_spec("default"), plan.study_rows, plan.study_repeats)
    document = {
        "kind": "shoal-bench-matrix",
        "version": 1,
        "plan": _plan_record(plan),
        "machine": machine_facts().as_record(),
        "cells": cells,
        "max_sustained": searches,
        "encodings": [row.as_record() for row in study],
        "wall_s": round(time.monotonic() - runner.started, 1),
    }
    document["targets"] = targets(document)
    runner.say(f"done in {document['wall_s']:.0f} s")
    return document


def _run_grid(runner: _Runner) -> list[dict[str, Any]]:
    runs = runner.plan.runs()
    by_cell: dict[Cell, dict[str, Any]] = {}
    for index, (cell, variant) in enumerate(runs, 1):
        entry = by_cell.setdefault(
            cell,
            {
                "scenario": cell.scenario,
                "rate_per_sensor": cell.rate,
                "batch": cell.batch,
                "baseline": None,
                "shoal": [],
            },
        )
        what = "baseline (Flask/Waitress/pandas)" if variant is None else f"shoal {variant.label}"
        runner.say(
            f"{index}/{len(runs)} scenario {cell.scenario}, {cell.rate:g}/s per sensor, "
            f"batch {cell.batch:,}: {what}"
        )
        if variant is None:
            entry["baseline"] = runner.baseline(cell)
            record = entry["baseline"]
        else:
            record = {"variant": variant.label, **runner.shoal(cell, variant)}
            entry["shoal"].append(record)
        runner.say(f"    {one_line(record)}")
    for entry in by_cell.values():
        base = entry["baseline"]
        for record in entry["shoal"]:
            record["vs_baseline"] = ratios(record, base) if base else None
    return list(by_cell.values())


def _run_searches(runner: _Runner) -> dict[str, Any]:
    plan = runner.plan.max_search
    assert plan is not None
    cores = runner.plan.machine_cores
    cell = Cell(plan.scenario, 1.0, plan.batch)
    searches: dict[str, Any] = {}
    for key, label, start, measure in (
        (
            "baseline_one",
            "baseline, 1 Waitress thread",
            plan.baseline_start_rate,
            lambda r: runner.baseline(replace(cell, rate=r), duration_s=plan.duration_s),
        ),
        (
            "shoal_one",
            "shoal, 1 worker",
            plan.shoal_start_rate,
            lambda r: runner.shoal(replace(cell, rate=r), Variant(), duration_s=plan.duration_s),
        ),
        (
            "baseline_machine",
            f"baseline, {cores} Waitress processes",
            None,
            lambda r: runner.baseline(
                replace(cell, rate=r), instances=cores, duration_s=plan.duration_s
            ),
        ),
        (
            "shoal_machine",
            f"shoal, {cores} workers",
            None,
            lambda r: runner.shoal(
                replace(cell, rate=r), Variant(), workers=cores, duration_s=plan.duration_s
            ),
        ),
    ):
        # The whole-machine search starts where the one-instance search ended.
        single = searches.get(key.replace("machine", "one"), {})
        first = start or max(single.get("max_sustained_rate_per_sensor") or 0.0, 1.0)
        runner.say(
            f"highest sustained rate: {label} (scenario {plan.scenario}, batch {plan.batch:,})"
        )

        def step(
            rate: float, measure: Callable[[float], dict[str, Any]] = measure
        ) -> dict[str, Any]:
            record = measure(rate)
            runner.say(f"    {rate:g}/s per sensor: {one_line(record)}")
            return record

        searches[key] = {"label": label, **search_max(step, first, plan.factor, plan.max_steps)}
    return searches


def search_max(
    measure: Callable[[float], dict[str, Any]],
    start_rate: float,
    factor: float = 2.0,
    max_steps: int = 5,
    tolerance: float = 0.15,
) -> dict[str, Any]:
    """The highest sustained rate: step by ``factor`` until the verdict flips, then bisect.

    ``measure(rate)`` runs at ``rate`` per sensor and returns a summary with ``sustained``
    and ``achieved_meas_per_s``. Stops after ``max_steps`` runs, or once the sustained and
    the failed rate are within ``tolerance`` of each other.
    """
    steps: list[dict[str, Any]] = []
    held: float | None = None
    failed: float | None = None
    rate = start_rate
    for _ in range(max_steps):
        record = {"rate_per_sensor": rate, **measure(rate)}
        steps.append(record)
        if record["sustained"]:
            held = max(held or 0.0, rate)
        else:
            failed = min(failed or math.inf, rate)
        if failed is None:
            rate *= factor
        elif held is None:
            rate /= factor
        elif failed / held <= 1.0 + tolerance:
            break
        else:
            rate = math.sqrt(held * failed)
    sustained = [s for s in steps if s["sustained"]]
    best = max(sustained, key=lambda s: s["achieved_meas_per_s"], default=None)
    return {
        "max_sustained_meas_per_s": best["achieved_meas_per_s"] if best else 0.0,
        "max_sustained_rate_per_sensor": best["rate_per_sensor"] if best else None,
        "first_failed_rate_per_sensor": failed,
        "per_core_used": best.get("per_core_meas_per_s") if best else None,
        "best": best,
        "steps": steps,
    }


# -- summaries and ratios ---------------------------------------------------------------------


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """The figures the matrix compares, for a baseline or a shoal run record (kept whole too)."""
    baseline = record.get("system") == "baseline"
    sut = BASELINE_SUT if baseline else SHOAL_SUT
    window = [c for c in record.get("window_components", []) if c["name"].startswith(sut)]
    peaks = {c["name"]: c.get("rss_mb") for c in record.get("components", [])}
    cpu_percent = sum(c["cpu_percent"] for c in window)
    rss = sum(c.get("rss_mb") or peaks.get(c["name"]) or 0.0 for c in window)
    achieved = record["achieved_meas_per_s"]
    t_rr = record["t_rr_ms"] if baseline else record["apply_latency_ms"]
    t_ex = record["t_ex_ms"] if baseline else record.get("worker_handle_ms")
    sustained = record["sustained"] if baseline else _shoal_sustained(record)
    unconfirmed = {"batches": 0, "measurements": 0, "waited_s": None}
    if baseline:
        loss = record["unprocessed_measurements"]
        loss_note = "not processed (queued at gateways or failed)"
        mean_rows = record["mean_batch_rows"]
    else:
        loss = record["lost_measurements"] + record["duplicated_measurements"]
        loss_note = "lost + duplicated (count oracle)"
        batches = record.get("batches_published") or 0
        mean_rows = round(record["generated_measurements"] / batches, 1) if batches else None
        unconfirmed = {
            "batches": record.get("unconfirmed_batches", 0),
            "measurements": record.get("unconfirmed_measurements", 0),
            "waited_s": record.get("settle_waited_s"),
        }
    return {
        "system": "baseline" if baseline else "shoal",
        "offered_meas_per_s": record["offered_meas_per_s"],
        "achieved_meas_per_s": achieved,
        "sustained": sustained,
        "loss_measurements": loss,
        "loss_means": loss_note,
        "unconfirmed": unconfirmed,
        "late_measurements": record.get("late_measurements", 0),
        "mean_batch_rows": mean_rows,
        "t_ex_ms": t_ex,
        "t_rr_ms": t_rr,
        "sut_cpu_percent": round(cpu_percent, 1),
        "sut_rss_mb": round(rss, 1),
        "per_core_meas_per_s": round(achieved / (cpu_percent / 100.0), 1) if cpu_percent else None,
        "bytes_per_meas": record.get("bytes_per_meas"),
        "run": record,
    }


def _shoal_sustained(record: dict[str, Any]) -> bool:
    """``bench pipeline``'s verdict, allowing one batch per gateway in the achieved rate.

    Achieved rates come from counts of whole batches over the measured window, so with few,
    large batches per window they are off by up to one batch per gateway either way (the
    baseline's verdict allows the same). The other conditions are unchanged: exact
    accounting, the simulator kept up, and under two seconds of data unconfirmed at the end.
    """
    if record["sustained"]:
        return True
    offered = record["offered_meas_per_s"]
    gateways = {"A": 1, "B": 10}[record["scenario"]]
    granularity = gateways * record["batch"] / max(record["duration_s"], 1e-9)
    return bool(
        record["lost_measurements"] == 0
        and record["duplicated_measurements"] == 0
        and record["unconfirmed_batches"] == 0
        and record["achieved_meas_per_s"] >= SUSTAIN_FRACTION * offered - granularity
        and (record["simulator_meas_per_s"] or 0.0) >= SUSTAIN_FRACTION * offered
        and record.get("lag_settled_measurements", record["lag_at_end_measurements"])
        <= MAX_LAG_SECONDS * offered
    )


def ratios(shoal: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """Ratios shoal / baseline of the compared figures (below 1 is better but for rates)."""

    def q(summary: dict[str, Any] | None, key: str) -> float | None:
        return None if not summary else summary.get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    out: dict[str, float | None] = {}
    for name in ("t_ex_ms", "t_rr_ms"):
        for p in ("p50", "p95", "p99"):
            out[f"{name[:-3]}_{p}"] = div(q(shoal[name], p), q(baseline[name], p))
    for name in (
        "achieved_meas_per_s",
        "sut_cpu_percent",
        "sut_rss_mb",
        "bytes_per_meas",
        "per_core_meas_per_s",
    ):
        out[name] = div(shoal[name], baseline[name])
    return out


def targets(document: dict[str, Any]) -> dict[str, Any]:
    """The targets of the performance issue (20), from a matrix document.

    Per core against one Waitress thread >= 20x; at scenario A 25/s, batch 4,000, p99 of
    publish -> partials out <= 0.2x and of publish -> applied (shoal's t_rr) <= 0.35x the
    baseline's t_rr p99 (the first issue's targets were >= 10x and t_rr <= 0.2x).
    """
    out: dict[str, Any] = {}
    searches = document.get("max_sustained") or {}
    base, ours = searches.get("baseline_one"), searches.get("shoal_one")
    if base and ours and base["per_core_used"] and ours["per_core_used"]:
        out["throughput_per_core"] = {
            "shoal_meas_per_s": ours["max_sustained_meas_per_s"],
            "shoal_per_core": ours["per_core_used"],
            "baseline_meas_per_s": base["max_sustained_meas_per_s"],
            "baseline_per_core": base["per_core_used"],
            "ratio": round(ours["per_core_used"] / base["per_core_used"], 2),
            "raw_ratio": round(
                ours["max_sustained_meas_per_s"] / max(base["max_sustained_meas_per_s"], 1e-9), 2
            ),
            "target": ">= 20",
        }
    scenario, rate, batch = TARGET_CELL
    for cell in document.get("cells", []):
        if (cell["scenario"], cell["rate_per_sensor"], cell["batch"]) != (scenario, rate, batch):
            continue
        base_run = cell["baseline"]
        ours_run = next((s for s in cell["shoal"] if s["variant"] == Variant().label), None)
        if not (base_run and ours_run and base_run["t_rr_ms"]):
            continue
        base_p99 = base_run["t_rr_ms"]["p99"]
        # shoal's t_rr is publish -> applied at the combiner; publish -> partials out is the
        # baseline's request -> reply (its reply carries the batch's aggregates).
        for key, ours_ms, target in (
            ("p99_publish_to_partial_at_A_4000", ours_run["run"].get("publish_to_partial_ms"), 0.2),
            ("p99_t_rr_at_A_4000", ours_run["t_rr_ms"], 0.35),
        ):
            if ours_ms and ours_ms.get("p99") is not None:
                out[key] = {
                    "shoal_ms": ours_ms["p99"],
                    "baseline_ms": base_p99,
                    "ratio": round(ours_ms["p99"] / base_p99, 3),
                    "target": f"<= {target}",
                }
    return out


def one_line(summary: dict[str, Any]) -> str:
    """A progress line for one run."""
    t_rr = summary.get("t_rr_ms") or {}
    unconfirmed = unconfirmed_text(summary["run"])
    return (
        f"offered {summary['offered_meas_per_s']:,.0f}/s, achieved "
        f"{summary['achieved_meas_per_s']:,.0f}/s "
        f"({'sustained' if summary['sustained'] else 'NOT sustained'}), "
        f"t_rr p99 {t_rr.get('p99', float('nan')):.0f} ms, CPU {summary['sut_cpu_percent']:.0f} %, "
        f"loss {summary['loss_measurements']:,}" + (f", {unconfirmed}" if unconfirmed else "")
    )


def _plan_record(plan: MatrixPlan) -> dict[str, Any]:
    record = asdict(plan)
    record["cells"] = [asdict(c) for c in plan.cells]
    return record
