"""``shoal bench pipeline`` pairs on one invocation: plain vs rules vs a vectorised UDF.

Run from the repository root::

    python docs/bench/rules_pipeline_pairs.py [--rounds 3] [--rate 100] [--duration 10]
        [--json docs/bench/rules-pipeline-pairs.json]

Each round runs the whole pipeline (``shoal.loadtest.bench_pipeline.run_pipeline``: simulator,
broker, two workers, combiner, as processes) three times back to back, at the same offered
rate, above what this machine sustains, so that the achieved rate is the pipeline's capacity:

- ``plain``: the default pipeline (ten aggregates, 10-second tumbling windows);
- ``rules``: the same with ``derive.value = value + 0``, ``derive.plausible = value > -60 AND
  value < 160`` and ``where = plausible AND type IS NOT NULL`` (keeps every row, so both
  sides aggregate the same rows);
- ``udf``: the same as plain with ``derive.value = calibrate(value)``, the UDF example's
  numpy cubic (``processors/examples/udf.toml``), run through the guard.

Every variant gets the same input: the gateways send the attribute columns (``type``,
``unit``) to all three, as the ``rules`` variant reads ``type`` (before, the other two ran on
lighter batches without them).

The figure is, per round, achieved(rules) / achieved(plain) and achieved(udf) /
achieved(plain) (combiner heartbeats, the measured window only), and the medians over the
rounds; also the workers' CPU seconds per million measurements applied. Every run's record
is kept (without the per-component lists) with the load average at its start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from shoal.loadtest import bench_pipeline as bench
from shoal.processors.spec import load_pipeline


def variants(directory: Path) -> dict[str, Path]:
    """The three spec files: plain, rules, udf."""
    plain = tomllib.loads(Path("processors/default.toml").read_text(encoding="utf-8"))
    udf_example = tomllib.loads(Path("processors/examples/udf.toml").read_text(encoding="utf-8"))
    specs: dict[str, dict[str, Any]] = {
        "plain": plain,
        "rules": {
            **plain,
            "where": "plausible AND type IS NOT NULL",
            "derive": {"value": "value + 0", "plausible": "value > -60 AND value < 160"},
        },
        "udf": {
            **plain,
            "derive": {"value": "calibrate(value)"},
            "functions": {"calibrate": udf_example["functions"]["calibrate"]},
        },
    }
    out = {}
    for name, raw in specs.items():
        path = directory / f"{name}.toml"
        path.write_text(tomli_w.dumps(raw), encoding="utf-8")
        out[name] = path
    return out


def worker_cpu_per_million(record: dict[str, Any]) -> float | None:
    """Workers' CPU seconds in the measured window per million measurements applied."""
    seconds = sum(
        c["cpu_seconds"] for c in record["window_components"] if c["name"].startswith("worker")
    )
    applied = record["achieved_meas_per_s"] * record["duration_s"]
    return round(seconds / applied * 1e6, 3) if applied else None


def main() -> int:
    """Run the rounds, print one JSON line per run and the summary, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="per sensor, scenario B")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    paths = variants(Path(tempfile.mkdtemp(prefix="shoal-rules-pairs-")))
    runs: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        for name, path in paths.items():
            load = [round(x, 2) for x in os.getloadavg()]
            config = bench.PipelineBenchConfig(
                spec=load_pipeline(path),
                spec_source=str(path),
                scenario="B",
                rate=args.rate,
                duration_s=args.duration,
                attributes=True,  # one input for all: the rules read ``type``
            )
            record = bench.run_pipeline(config, None)
            run = {
                "round": round_no,
                "variant": name,
                "loadavg_at_start": load,
                "achieved_meas_per_s": record["achieved_meas_per_s"],
                "achieved_basis": record["achieved_basis"],
                "offered_meas_per_s": record["offered_meas_per_s"],
                "simulator_meas_per_s": record["simulator_meas_per_s"],
                "lost": record["lost_measurements"],
                "duplicated": record["duplicated_measurements"],
                "deadletters": record["deadletters"],
                "worker_cpu_s_per_million": worker_cpu_per_million(record),
                "window_components": record["window_components"],
                "duration_s": record["duration_s"],
            }
            runs.append(run)
            line = json.dumps({k: v for k, v in run.items() if k != "window_components"})
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    ratios: dict[str, list[float]] = {"rules": [], "udf": []}
    cpu_ratios: dict[str, list[float]] = {"rules": [], "udf": []}
    for round_no in range(args.rounds):
        by = {r["variant"]: r for r in runs if r["round"] == round_no}
        for name, values in ratios.items():
            values.append(
                round(by[name]["achieved_meas_per_s"] / by["plain"]["achieved_meas_per_s"], 3)
            )
            if by[name]["worker_cpu_s_per_million"] and by["plain"]["worker_cpu_s_per_million"]:
                cpu_ratios[name].append(
                    round(
                        by["plain"]["worker_cpu_s_per_million"]
                        / by[name]["worker_cpu_s_per_million"],
                        3,
                    )
                )
    summary = {
        "rate_per_sensor": args.rate,
        "duration_s": args.duration,
        "throughput_ratio": ratios,
        "throughput_ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
        "worker_cpu_ratio": cpu_ratios,
        "worker_cpu_ratio_median": {
            k: statistics.median(v) if v else None for k, v in cpu_ratios.items()
        },
        "machine": bench.machine(),
        "runs": runs,
    }
    sys.stdout.write(json.dumps({k: v for k, v in summary.items() if k != "runs"}) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
