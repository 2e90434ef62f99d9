"""``shoal archive --dir DIR``: write raw batches and window results to partitioned Parquet."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

from shoal._cli.common import (
    add_broker_options,
    add_metrics_options,
    add_stop_option,
    broker_settings,
    metrics_address,
    stop_timeout,
    topics,
)
from shoal.archive.rollover import RolloverPolicy
from shoal.errors import ConfigError

_POLICY = RolloverPolicy()


def register(sub: Any) -> None:
    """Add the ``archive`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "archive",
        help="archive raw batches and window results to partitioned Parquet",
        description="Subscribe to the ingest topics (a normal subscription, next to the "
        "workers) and the window result topics, and write hive-partitioned Parquet files "
        "under DIR (results/pipeline=.../date=.../hour=..., batches/stream=.../...). Files "
        "appear atomically; Ctrl-C writes what is buffered and exits. Read them with "
        "shoal.archive.read_results/read_batches, polars or pandas; replay them with "
        "shoal replay.",
    )
    parser.add_argument("--dir", type=Path, required=True, help="archive folder")
    what = parser.add_argument_group("what")
    what.add_argument("--no-batches", action="store_true", help="do not archive raw batches")
    what.add_argument("--no-results", action="store_true", help="do not archive window results")
    what.add_argument(
        "--pipeline",
        action="append",
        default=[],
        metavar="NAME",
        help="archive this pipeline's results (repeatable; default: every pipeline)",
    )
    what.add_argument(
        "--inputs",
        action="append",
        default=[],
        metavar="FILTER",
        help="ingest topic filter for raw batches, below the topic root (repeatable; "
        "default ingest/+/+)",
    )
    files = parser.add_argument_group("files")
    files.add_argument(
        "--max-rows", type=int, default=_POLICY.max_rows, help="rows per file (%(default)s)"
    )
    files.add_argument(
        "--max-mb",
        type=float,
        default=_POLICY.max_bytes / 2**20,
        help="MiB buffered per file (%(default)s)",
    )
    files.add_argument(
        "--max-age",
        type=float,
        default=_POLICY.max_age_s,
        help="seconds a row waits for its file (%(default)s)",
    )
    files.add_argument(
        "--budget-mb",
        type=float,
        default=_POLICY.max_buffered_bytes / 2**20,
        help="MiB buffered and being written, in all: the memory bound (%(default)s)",
    )
    files.add_argument(
        "--compression",
        default="zstd",
        choices=("zstd", "lz4", "snappy", "uncompressed"),
        help="Parquet codec (default zstd)",
    )
    add_broker_options(parser)
    parser.add_argument(
        "--client-id",
        default="",
        help="stable client id for a persistent session (the broker queues what a "
        "restarting archive misses); default: a private clean session",
    )
    add_metrics_options(parser)
    add_stop_option(parser)
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Archive until Ctrl-C, SIGTERM or ``--duration``; print what was written."""
    from shoal.archive import ArchiveConfig, Archiver  # noqa: PLC0415

    if args.no_batches and args.no_results:
        raise ConfigError("--no-batches and --no-results leave nothing to archive")
    policy = RolloverPolicy(
        max_rows=args.max_rows,
        max_bytes=int(args.max_mb * 2**20),
        max_age_s=args.max_age,
        max_buffered_bytes=int(args.budget_mb * 2**20),
    )
    config = ArchiveConfig(
        root=args.dir,
        broker=broker_settings(args),
        topics=topics(args),
        batches=not args.no_batches,
        results=not args.no_results,
        inputs=tuple(args.inputs) or ("ingest/+/+",),
        pipelines=tuple(args.pipeline),
        policy=policy,
        compression=args.compression,
        client_id=args.client_id,
    )

    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal._stopping import stop_signals  # noqa: PLC0415
    from shoal.observe.collectors import ArchiveCollector  # noqa: PLC0415

    address = metrics_address(args)
    grace = stop_timeout(args)

    async def main() -> Any:
        archiver = Archiver(config)
        loop = asyncio.get_running_loop()
        if args.duration:
            loop.call_later(args.duration, archiver.stop)
        running = asyncio.create_task(
            exposed(archiver.run(), address, lambda: ArchiveCollector(archiver), "shoal archive")
        )
        connected = asyncio.create_task(archiver.connected.wait())
        # Stopping writes the buffered rows out (no broker needed); the watchdog bounds it.
        with stop_signals("shoal archive", lambda: loop.call_soon_threadsafe(archiver.stop), grace):
            await asyncio.wait({running, connected}, return_when=asyncio.FIRST_COMPLETED)
            if connected.done():
                # Printed once subscribed: a script may wait for this line before sending data.
                print(
                    f"archiving {', '.join(config.filters())} from {config.broker.url} "
                    f"to {args.dir}",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                connected.cancel()
            return await running

    report = asyncio.run(main())
    if args.json:
        args.json.write_bytes(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2))
    print(
        f"shoal archive: {report.received_batches:,} batches and {report.received_results:,} "
        f"window messages received ({report.duplicate_results} duplicate windows dropped); "
        f"{report.files} files ({report.file_bytes / 2**20:,.1f} MiB, {report.rows_written:,} "
        f"rows) in {args.dir}; cpu {report.cpu_percent:.1f}% of one core over {report.wall_s:.1f} s"
    )
    return 0
