"""``shoal bench pool``: a pool worker's memory per deployed pipeline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from shoal.errors import ConfigError


def register_pool(benches: Any) -> None:
    """Add the ``pool`` and ``pipelines`` benchmarks."""
    _register_pipelines(benches)
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


def _register_pipelines(benches: Any) -> None:
    parser: argparse.ArgumentParser = benches.add_parser(
        "pipelines",
        help="many small pipelines on the pools: deploy time, first result, RSS, exactness",
        description="Start a broker, --workers pool workers and one pool combiner, deploy "
        "--count small pipelines while a gateway publishes, then count a known set of rows "
        "through every pipeline: deployed_s, first_result_s (p99, minus the window), "
        "worker_rss_mb, combiner_rss_mb, achieved_meas_per_s, lost_measurements, "
        "duplicated_measurements (shoal.loadtest.bench_pipelines).",
    )
    parser.add_argument("--count", type=int, default=1_000, help="pipelines (default 1000)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--batches", type=int, default=20, help="counted batches (default 20)")
    parser.add_argument("--rows", type=int, default=100, help="rows per batch (default 100)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="how long each step may take (default 300; a loaded machine needs more at 1000)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the record here")
    parser.set_defaults(run=_run_pipelines)


def _run_pipelines(args: argparse.Namespace) -> int:
    from shoal.loadtest import bench_pipelines as bench  # noqa: PLC0415 - run-time only

    if min(args.count, args.workers, args.batches, args.rows, args.timeout) <= 0:
        raise ConfigError("--count, --workers, --batches, --rows and --timeout must be positive")
    config = bench.BenchConfig(
        args.count, args.workers, args.batches, args.rows, timeout_s=args.timeout
    )
    print(f"shoal bench pipelines --count {args.count} --workers {args.workers}", flush=True)
    record = bench.run(config)
    print(bench.format_report(record))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")
    ok = record["lost_measurements"] == 0 and record["duplicated_measurements"] == 0
    return 0 if ok else 1
