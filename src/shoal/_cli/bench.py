"""``shoal bench <name>``: benchmarks run as commands (only ``encodings`` so far).

Each sub-command imports its benchmark module only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

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
