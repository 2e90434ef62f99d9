"""``shoal bench pool``: a pool worker's memory per deployed pipeline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from shoal.errors import ConfigError


def register_pool(benches: Any) -> None:
    """Add the ``pool`` benchmark."""
    pool: argparse.ArgumentParser = benches.add_parser(
        "pool",
        help="a pool worker's RSS with 1, 100, 1000 deployed pipelines",
        description="Start a broker and one pool worker (`shoal worker` without --pipeline), "
        "deploy small pipelines (retained documents) up to each count, run one batch through "
        "all of them, and report the worker's RSS, the memory per pipeline and how long the "
        "worker took to serve them and to handle the batch.",
    )
    pool.add_argument(
        "--counts",
        default="1,100,1000",
        metavar="N,N,...",
        help="deployed pipelines at each measurement (default 1,100,1000)",
    )
    pool.add_argument(
        "--combiner",
        action="store_true",
        help="measure a pool combiner (`shoal combiner` without --pipeline) owning every "
        "deployed pipeline's partition instead of a pool worker",
    )
    pool.add_argument("--json", type=Path, metavar="FILE", help="also write the record here")
    pool.set_defaults(run=run_pool)


def run_pool(args: argparse.Namespace) -> int:
    """Run the pool benchmark."""
    from shoal.loadtest import bench_pool as bench  # noqa: PLC0415 - run-time only

    try:
        counts = [int(part) for part in args.counts.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--counts takes whole numbers separated by commas: {exc}") from exc
    if not counts or min(counts) < 1:
        raise ConfigError("--counts must be positive")
    if args.combiner:
        from shoal.loadtest import bench_combiner_pool as hosts  # noqa: PLC0415

        print("shoal bench pool --combiner", flush=True)
        host_steps = hosts.run(counts)
        print(hosts.format_report(host_steps))
        record = hosts.as_record(host_steps)
    else:
        print("shoal bench pool", flush=True)
        steps = bench.run(counts)
        print(bench.format_report(steps))
        record = bench.as_record(steps)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")
    return 0
