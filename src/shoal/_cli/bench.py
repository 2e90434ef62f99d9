"""``shoal bench <name>``: benchmarks run as commands (``encodings``, ``pipeline``, ``matrix``).

Each sub-command imports its benchmark module only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from shoal._cli.bench_matrix import register_matrix
from shoal.errors import ConfigError


def register(sub: Any) -> None:
    """Add the ``bench`` command and its sub-commands."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="run a benchmark",
        description="Benchmarks that print a table and can write their records as JSON.",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    encodings = benches.add_parser(
        "encodings",
        help="wire size, encode and decode speed of every encoding",
        description="Encode synthetic batches in every encoding and decode them to "
        "DataFrames; report bytes per measurement and measurements per second (medians), "
        "with ratios against JSON rows.",
    )
    encodings.add_argument(
        "--sizes",
        type=_sizes,
        default="4000,16000,64000",
        metavar="N,N,...",
        help="batch sizes in measurements (default 4000,16000,64000)",
    )
    encodings.add_argument(
        "--repeat",
        type=int,
        default=None,
        metavar="N",
        help="timed samples per figure; the median is reported (default 7)",
    )
    encodings.add_argument("--json", type=Path, metavar="FILE", help="also write the records here")
    encodings.set_defaults(run=run_encodings)
    _register_pipeline(benches)
    register_matrix(benches)


def _register_pipeline(benches: Any) -> None:
    pipeline: argparse.ArgumentParser = benches.add_parser(
        "pipeline",
        help="simulator -> broker -> workers -> combiners on this machine",
        description="Run the whole pipeline as processes on this machine at a fixed offered "
        "rate and report achieved rate, loss and duplication (count oracle), latencies, and "
        "CPU and peak memory per component. --max steps the rate up to the highest sustained.",
    )
    pipeline.add_argument(
        "--pipeline", default="default", metavar="NAME|FILE", help="pipeline spec"
    )
    pipeline.add_argument(
        "--scenario", default="B", choices=["A", "B"], help="A: 1 x 1,000 sensors; B: 10 x 1,000"
    )
    pipeline.add_argument(
        "--rate", type=float, default=25.0, help="measurements/s per sensor (default 25)"
    )
    pipeline.add_argument(
        "--batch", type=int, default=16_000, help="rows per batch (default 16000)"
    )
    pipeline.add_argument("--encoding", default="binary", help="batch encoding (default binary)")
    pipeline.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    pipeline.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of measured load per run (default 30; 20 per --max step)",
    )
    pipeline.add_argument("--max", action="store_true", help="find the highest sustained rate")
    pipeline.add_argument(
        "--no-key-topics", action="store_true", help="skip per-key retained results"
    )
    pipeline.add_argument(
        "--gateway-spool",
        choices=["memory", "disk"],
        default="memory",
        help="simulated gateways' spool (default memory: gateways are separate devices)",
    )
    pipeline.add_argument("--json", type=Path, metavar="FILE", help="also write the record(s) here")
    pipeline.set_defaults(run=run_pipeline)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers: {text!r}")
    return sizes


def run_encodings(args: argparse.Namespace) -> int:
    """Run the encoding benchmark, print the table, optionally write JSON."""
    from shoal.loadtest import bench_encodings as bench  # noqa: PLC0415 - heavy, run-time only

    repeats = bench.DEFAULT_REPEATS if args.repeat is None else args.repeat
    if repeats < 1:
        raise ConfigError("--repeat must be at least 1")
    facts = bench.machine()
    print(f"shoal bench encodings\n{bench.describe(facts, repeats)}\n", flush=True)
    results = bench.run(
        args.sizes,
        repeats,
        progress=lambda r: print(f"  measured {r.codec} x {r.batch_size}", file=sys.stderr),
    )
    print(bench.format_table(results))
    if args.json is not None:
        records = [{**r.as_record(), "machine": facts.as_record()} for r in results]
        args.json.write_bytes(orjson.dumps(records, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"\nwrote {len(records)} records to {args.json}")
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    """Run the pipeline benchmark (one rate, or ``--max``)."""
    from shoal._cli.common import load_spec  # noqa: PLC0415
    from shoal.loadtest import bench_pipeline as bench  # noqa: PLC0415 - heavy, run-time only

    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    config = bench.PipelineBenchConfig(
        spec=load_spec(args.pipeline),
        spec_source=args.pipeline,
        scenario=args.scenario,
        rate=args.rate,
        batch=args.batch,
        encoding=args.encoding,
        workers=args.workers,
        duration_s=args.duration or (20.0 if args.max else 30.0),
        per_key_results=not args.no_key_topics,
        gateway_spool=args.gateway_spool,
    )
    if args.max:
        result = bench.run_max(config, sys.stderr)
        best = result["best"]
        print(f"\nhighest sustained rate: {result['max_sustained_meas_per_s']:,.0f} meas/s")
        if best is not None:
            print(bench.format_record(best))
        code = 0 if best is not None else 1
    else:
        result = bench.run_pipeline(config, sys.stderr)
        print(bench.format_record(result))
        code = (
            0 if result["lost_measurements"] == 0 and result["duplicated_measurements"] == 0 else 1
        )
    if args.json is not None:
        args.json.write_text(bench.dumps(result) + "\n")
        print(f"wrote {args.json}")
    return code
