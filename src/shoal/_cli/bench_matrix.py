"""``shoal bench matrix``: the research's grid, shoal vs the Flask/pandas baseline.

Registered by ``shoal._cli.bench``; the benchmark modules load only when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any


def register_matrix(benches: Any) -> None:
    """Add ``matrix`` to the ``bench`` sub-commands."""
    matrix: argparse.ArgumentParser = benches.add_parser(
        "matrix",
        help="the research's experiments: shoal vs the Flask/Waitress/pandas baseline",
        description="Run the research's grid (scenarios A and B, rates 4/12/25 per sensor, "
        "batches 4k-64k) for the Flask/Waitress/pandas baseline and for shoal, the highest "
        "sustained rate of each (one instance and the whole machine), and the encoding study; "
        "print progress, then a Markdown table. Needs the bench extra (Flask, Waitress).",
    )
    size = matrix.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="a subset that runs in under 10 minutes on 2 cores"
    )
    size.add_argument("--smoke", action="store_true", help="tiny rates, seconds (tests)")
    matrix.add_argument("--json", type=Path, metavar="FILE", help="write the document here")
    matrix.add_argument("--markdown", type=Path, metavar="FILE", help="write the tables here")
    matrix.add_argument("--plots", type=Path, metavar="DIR", help="write PNG figures here")
    matrix.add_argument(
        "--no-max", action="store_true", help="skip the highest-sustained-rate searches"
    )
    matrix.set_defaults(run=run_matrix)


def run_matrix(args: argparse.Namespace) -> int:
    """Run the matrix; exit 1 if shoal lost or duplicated anything."""
    import orjson  # noqa: PLC0415 - run-time only

    from shoal._cli.common import load_spec  # noqa: PLC0415
    from shoal.loadtest import bench_matrix, bench_report  # noqa: PLC0415

    plan = (
        bench_matrix.smoke_plan()
        if args.smoke
        else bench_matrix.quick_plan()
        if args.quick
        else bench_matrix.full_plan()
    )
    if args.no_max:
        plan = dataclasses.replace(plan, max_search=None)
    from shoal.loadtest.baseline._extra import require  # noqa: PLC0415

    # Fail before an hour of measuring, not after it.
    for module in ("flask", "waitress", *(["matplotlib"] if args.plots is not None else [])):
        require(module)
    print(f"shoal bench matrix: plan {plan.name!r}, {len(plan.runs())} grid runs", file=sys.stderr)
    document = bench_matrix.run(plan, load_spec, sys.stderr)
    text = bench_report.markdown(document)
    print(text)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown is not None:
        args.markdown.write_text(text)
        print(f"wrote {args.markdown}", file=sys.stderr)
    if args.plots is not None:
        from shoal.loadtest.bench_plots import write_plots  # noqa: PLC0415

        for path in write_plots(document, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    runs = [run for cell in document["cells"] for run in cell["shoal"]]
    runs += [
        step
        for search in (document.get("max_sustained") or {}).values()
        for step in (search or {}).get("steps", [])
        if step.get("system") == "shoal"
    ]
    lossy = [run for run in runs if run["loss_measurements"]]
    unconfirmed = [run for run in runs if (run.get("unconfirmed") or {}).get("batches")]
    if lossy:
        print(f"shoal lost or duplicated measurements in {len(lossy)} run(s)", file=sys.stderr)
    if unconfirmed:
        print(
            f"{len(unconfirmed)} shoal run(s) ended with batches unconfirmed (still spooled at "
            "the gateways): the pipeline did not drain the backlog while settling",
            file=sys.stderr,
        )
    return 1 if lossy or unconfirmed else 0
