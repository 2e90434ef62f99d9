"""``shoal bench sink``: scenario A into PostgreSQL through kill -9 and a database restart."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson


def register_sink(benches: Any) -> None:
    """Add ``shoal bench sink``."""
    parser: argparse.ArgumentParser = benches.add_parser(
        "sink",
        help="scenario A into PostgreSQL with the sink killed -9 twice and the database "
        "restarted: exactness and the sink's throughput",
        description="Run scenario A (1 gateway x 1,000 sensors) through a local pipeline "
        "with 1 s tumbling and 2 s/1 s hopping windows and follow its results into a "
        "throwaway PostgreSQL server with 'shoal sink postgres', killed -9 at 30%% and 70%% "
        "of the run while the database is killed and restarted at 50%%. Then a second sink "
        "drains the whole run's results, kept for it by the broker: rows per second of "
        "draining is the sink's throughput (window x keys per second). Both tables must "
        "equal the latest revisions a consumer saw, with no duplicate rows. Needs "
        "PostgreSQL installed (make bootstrap) and the sinks extra (psycopg).",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument(
        "--rate", type=float, default=25.0, help="measurements/s per sensor (default 25)"
    )
    parser.add_argument("--batch", type=int, default=16_000, help="rows per batch (default 16000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--no-faults", action="store_true", help="no kills, no database restart")
    parser.add_argument("--run-dir", type=Path, help="keep logs and data here")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the record as JSON")
    parser.set_defaults(run=run_sink)


def run_sink(args: argparse.Namespace) -> int:
    """Run the benchmark; exit 1 unless both tables equal the oracle."""
    from shoal.loadtest.bench_sink import SinkBenchConfig, run_sink_bench  # noqa: PLC0415

    record = run_sink_bench(
        SinkBenchConfig(
            duration_s=args.duration,
            rate=args.rate,
            batch=args.batch,
            workers=args.workers,
            faults=not args.no_faults,
            run_dir=args.run_dir,
        ),
        progress=sys.stderr,
    )
    if args.json:
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    faulted, capacity = record["tables"]["faulted"], record["tables"]["capacity"]
    print(
        f"shoal bench sink: scenario A for {record['duration_s']:.0f} s, "
        f"{record['result_rows']:,} result rows in {record['result_messages']:,} messages; "
        f"faults {[f['fault'] for f in record['faults']]}\n"
        f"  faulted sink table: {faulted}\n"
        f"  capacity sink table: {capacity}\n"
        f"  sink throughput: {record['sink_rows_per_s']:,} windows x keys per second "
        f"({record['sink_messages_per_s']:,} messages/s, drained in "
        f"{record['capacity_drain_s']} s)\n"
        f"  {'EXACT' if record['exact'] else 'NOT EXACT'}"
    )
    return 0 if record["exact"] else 1
