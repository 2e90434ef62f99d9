"""``shoal up``: broker, pipeline, simulated gateways and a live view (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shoal._cli.common import add_pipeline_option, load_spec


def register(sub: Any) -> None:
    """Add the ``up`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "up",
        help="run broker + pipeline + simulated gateways with a live view",
        description="Start the embedded Mosquitto, the pipeline's combiners and workers, and "
        "simulated gateways; show rates, lag and results live. Ctrl-C (or --duration) stops "
        "everything cleanly and prints a summary that accounts for every measurement.",
    )
    add_pipeline_option(parser)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--scenario",
        default="A",
        help="simulated gateways: A (1 x 1,000 sensors), B (10 x 1,000) or none (default A)",
    )
    parser.add_argument("--rate", type=float, default=25.0, help="measurements/s per sensor")
    parser.add_argument("--batch", type=int, default=4_000, help="rows per batch (default 4000)")
    parser.add_argument("--encoding", default="binary", help="batch encoding (default binary)")
    parser.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    parser.add_argument("--profile", default="dev", help="broker profile (default dev)")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep logs and state here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run until Ctrl-C or ``--duration``; exit 0 only if nothing was lost."""
    from shoal.runtime.up import Up, UpConfig  # noqa: PLC0415

    if args.workers < 1:
        from shoal.errors import ConfigError  # noqa: PLC0415

        raise ConfigError("--workers must be at least 1")
    config = UpConfig(
        spec=load_spec(args.pipeline),
        spec_source=args.pipeline,
        workers=args.workers,
        profile=args.profile,
        scenario=None if args.scenario.lower() == "none" else args.scenario,
        rate=args.rate,
        batch=args.batch,
        encoding=args.encoding,
        duration_s=args.duration,
        run_dir=args.run_dir,
    )
    accounting = Up(config).run()
    return 0 if accounting.exact else 1
