"""``shoal bench memory``: combiner and worker RSS against keys and open windows."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import orjson


def register_memory(benches: Any) -> None:
    """Add ``shoal bench memory``."""
    parser: argparse.ArgumentParser = benches.add_parser(
        "memory",
        help="combiner and worker RSS per key and open window (no broker)",
        description="For each number of keys and of open windows, build the partials a "
        "worker would for every key in every window and apply them to a combiner core "
        "without closing a window, each figure in a fresh process; print RSS over the "
        "process's warm baseline and bytes per key per open window, and the same for a "
        "worker (which keeps nothing across batches). Size the combiner's "
        "[limits] max_state_cells with it.",
    )
    parser.add_argument(
        "--pipeline", default="default", metavar="NAME|FILE", help="pipeline spec (default)"
    )
    parser.add_argument(
        "--keys", default="10000,100000,1000000", metavar="N,N,...", help="keys to measure"
    )
    parser.add_argument(
        "--windows", default="1,4", metavar="N,N,...", help="open windows to measure (1,4)"
    )
    parser.add_argument(
        "--rows-per-key", type=int, default=2, help="rows per key and window (default 2)"
    )
    parser.add_argument("--batch", type=int, default=16_000, help="rows per batch (default 16000)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the records here")
    parser.set_defaults(run=run_memory)


def _counts(text: str) -> list[int]:
    from shoal.errors import ConfigError  # noqa: PLC0415

    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"expected positive integers separated by commas, not {text!r}")
    return values


def run_memory(args: argparse.Namespace) -> int:
    """Measure every (role, keys, windows) figure and print the table."""
    from shoal._cli.common import load_spec  # noqa: PLC0415
    from shoal.errors import ConfigError  # noqa: PLC0415
    from shoal.loadtest import bench_memory as bench  # noqa: PLC0415 - heavy, run-time only

    if args.rows_per_key < 1 or args.batch < 1:
        raise ConfigError("--rows-per-key and --batch must be positive")
    spec = load_spec(args.pipeline)
    figures = []
    for role in ("combiner", "worker"):
        for windows in _counts(args.windows):
            for keys in _counts(args.keys):
                print(f"  measuring {role}: {keys:,} keys x {windows} windows", file=sys.stderr)
                figures.append(
                    bench.measure(
                        spec,
                        role,
                        keys,
                        windows,
                        rows_per_key=args.rows_per_key,
                        batch=args.batch,
                    )
                )
    load = os.getloadavg()
    print(f"shoal bench memory (pipeline {spec.name}, {args.rows_per_key} rows per key and window)")
    print(bench.format_table(figures, load))
    if args.json is not None:
        record = {
            "pipeline": spec.name,
            "rows_per_key": args.rows_per_key,
            "batch": args.batch,
            "load_avg": list(load),
            "figures": [f.as_record() for f in figures],
        }
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}")
    return 0
