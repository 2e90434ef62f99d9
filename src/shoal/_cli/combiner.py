"""``shoal combiner``: one partition of a pipeline's second phase."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shoal._cli.common import (
    add_broker_options,
    add_pipeline_option,
    broker_settings,
    load_spec,
    topics,
)


def register(sub: Any) -> None:
    """Add the ``combiner`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "combiner",
        help="run a pipeline combiner partition (phase two: merge, close windows, confirm)",
        description="Merge partial aggregates of one key partition, close windows on the "
        "watermark, publish results, checkpoint state and confirm batches to gateways.",
    )
    add_pipeline_option(parser)
    add_broker_options(parser)
    parser.add_argument("--partition", type=int, default=0, help="partition index (default 0)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="checkpoint folder (default: var/combiner/<pipeline>-<partition>)",
    )
    parser.add_argument(
        "--no-key-topics",
        action="store_true",
        help="do not publish the retained per-key results/<pipeline>/<key> topics",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one combiner partition until signalled."""
    from shoal._cli._run import run_until_signalled  # noqa: PLC0415
    from shoal.runtime.combiner import CombinerConfig, CombinerRuntime  # noqa: PLC0415

    spec = load_spec(args.pipeline)
    if not 0 <= args.partition < spec.partitions:
        from shoal.errors import ConfigError  # noqa: PLC0415

        raise ConfigError(
            f"--partition {args.partition} is outside 0..{spec.partitions - 1} "
            f"(pipeline {spec.name!r} has {spec.partitions} partitions)"
        )
    state_dir = args.state_dir or Path("var") / "combiner" / f"{spec.name}-{args.partition}"
    config = CombinerConfig(
        spec=spec,
        partition=args.partition,
        broker=broker_settings(args),
        topics=topics(args),
        state_dir=state_dir,
        per_key_results=not args.no_key_topics,
    )
    runtime = CombinerRuntime(config)
    run_until_signalled(runtime.run(), runtime.stop)
    return 0
