"""``shoal replay --archive DIR --pipeline NAME``: a pipeline over archived batches, offline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shoal._cli.common import add_pipeline_option, load_spec


def register(sub: Any) -> None:
    """Add the ``replay`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "replay",
        help="run a pipeline over archived raw batches, offline",
        description="Decode the raw batches of a shoal archive and run them through the "
        "pipeline's own aggregation code (no broker). Prints a summary; --out writes the "
        "window results as Parquet; --compare checks them against the live results in the "
        "archive (counts exact, values within --rel-tol).",
    )
    parser.add_argument("--archive", type=Path, required=True, help="archive folder")
    add_pipeline_option(parser)
    parser.add_argument("--start-ms", type=int, help="only batches received at or after this")
    parser.add_argument("--end-ms", type=int, help="only batches received before this")
    parser.add_argument("--out", type=Path, metavar="FILE", help="write the results (Parquet)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="compare with the archived live results of the pipeline (exit 1 if they differ)",
    )
    parser.add_argument(
        "--rel-tol", type=float, default=1e-9, help="relative tolerance of float values"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Replay, summarise, optionally write and compare."""
    from shoal.archive import compare_results, read_results, replay  # noqa: PLC0415

    spec = load_spec(args.pipeline)
    result = replay(spec, args.archive, start_ms=args.start_ms, end_ms=args.end_ms)
    report = result.report
    print(
        f"shoal replay {spec.name}: {report.batches_archived:,} archived batches, "
        f"{report.batches_applied:,} applied ({report.duplicates:,} re-sends dropped, "
        f"{report.unreadable} unreadable, {report.rejected} rejected); "
        f"{report.windows:,} windows, {report.rows_applied:,} measurements counted, "
        f"{report.rows_late:,} late"
    )
    for gateway, gaps in report.gaps.items():
        print(f"  gateway {gateway}: seqs missing from the archive: {gaps}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result.results.write_parquet(args.out)
        print(f"wrote {result.results.height:,} rows to {args.out}")
    if not args.compare:
        return 0
    live = read_results(args.archive, spec.name, start_ms=args.start_ms, end_ms=args.end_ms)
    if live.height == 0:
        print(f"no archived results of {spec.name!r} to compare with", file=sys.stderr)
        return 1
    comparison = compare_results(live, result.results, rel_tol=args.rel_tol)
    print(f"live vs replay: {comparison}")
    if not comparison.equal:
        print(comparison.examples, file=sys.stderr)
    return 0 if comparison.equal else 1
