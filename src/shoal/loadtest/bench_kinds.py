"""``shoal bench pipeline --window tumbling,sliding,...``: window kinds against the first one.

Every window kind must keep up with tumbling windows (docs/benchmarks.md, "Window kinds"): at
least half of their throughput. Machines of one kind differ by up to 2x, and a shared one from
one minute to the next, so kinds are only compared within one invocation: in rounds, each
running every kind once in the order given (with ``--max``: its highest sustained rate; else
the rate it achieved at the offered one), and per round each kind's figure divided by the
first kind's (the baseline) of the same round. Reported per kind: the median, lowest and
highest figure over the rounds, and the median of its per-round ratios.

The runs themselves are ``bench_pipeline``'s (``run_one`` runs one kind once); this module
only orders them and summarises.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from shoal.errors import ConfigError

RunOne = Callable[[str], dict[str, Any]]
"""Runs the pipeline once with the preset window of a kind; returns its record."""


def parse_kinds(text: str) -> tuple[str, ...]:
    """``tumbling,sliding`` -> the kinds, in order, each once (the first is the baseline)."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    if not kinds:
        raise ConfigError(f"--window: no window kind in {text!r}", field="window")
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:
        raise ConfigError(f"--window names {', '.join(repeated)} twice", field="window")
    return kinds


def figure(record: dict[str, Any]) -> float:
    """A run's throughput: highest sustained rate (``--max``), else the achieved rate."""
    if "max_sustained_meas_per_s" in record:
        return float(record["max_sustained_meas_per_s"])
    return float(record["achieved_meas_per_s"])


def exact(record: dict[str, Any]) -> bool:
    """Nothing lost or duplicated in the run (every step of a ``--max`` search)."""
    runs = record.get("steps", [record])
    return all(
        run["lost_measurements"] == 0 and run["duplicated_measurements"] == 0 for run in runs
    )


def compare_kinds(
    kinds: Sequence[str],
    rounds: int,
    run_one: RunOne,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Run every kind ``rounds`` times, interleaved; figures and ratios to ``kinds[0]``."""
    if rounds < 1:
        raise ConfigError("--rounds must be at least 1", field="rounds")
    runs: list[dict[str, Any]] = []
    for number in range(1, rounds + 1):
        for kind in kinds:
            if progress is not None:
                print(f"== round {number}/{rounds}: {kind}", file=progress, flush=True)
            record = run_one(kind)
            runs.append({"round": number, "kind": kind, "meas_per_s": figure(record), **record})
    return {
        "baseline": kinds[0],
        "rounds": rounds,
        "summary": summarise(kinds, runs),
        "runs": runs,
    }


def summarise(kinds: Sequence[str], runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: median/min/max figure, per-round ratios to the baseline and their median."""
    baseline = {r["round"]: r["meas_per_s"] for r in runs if r["kind"] == kinds[0]}
    summary: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        figures = [r["meas_per_s"] for r in mine]
        ratios = [
            r["meas_per_s"] / baseline[r["round"]] if baseline.get(r["round"]) else None
            for r in mine
        ]
        known = [x for x in ratios if x is not None]
        summary[kind] = {
            "median_meas_per_s": statistics.median(figures),
            "min_meas_per_s": min(figures),
            "max_meas_per_s": max(figures),
            "ratios": [None if x is None else round(x, 4) for x in ratios],
            "median_ratio": round(statistics.median(known), 4) if known else None,
            "exact": all(exact(r) for r in mine),
        }
    return summary


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a table (one line per kind)."""
    baseline = result["baseline"]
    lines = [
        f"window kinds against {baseline}, {result['rounds']} round(s), interleaved",
        f"  {'kind':<10} {'median meas/s':>14} {'lowest':>12} {'highest':>12}"
        f"   {'/ ' + baseline + ' per round':<28} {'median':>7}  exact",
    ]
    for kind, row in result["summary"].items():
        ratios = ", ".join("-" if x is None else f"{x:.2f}" for x in row["ratios"])
        median = "-" if row["median_ratio"] is None else f"{row['median_ratio']:.2f}"
        lines.append(
            f"  {kind:<10} {row['median_meas_per_s']:>14,.0f} {row['min_meas_per_s']:>12,.0f} "
            f"{row['max_meas_per_s']:>12,.0f}   {ratios:<28} {median:>7}  "
            f"{'yes' if row['exact'] else 'NO'}"
        )
    return "\n".join(lines)
