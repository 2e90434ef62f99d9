"""``shoal combiner``: one partition of a pipeline's second phase, or a member of the pool."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from shoal._cli.common import (
    add_broker_options,
    add_metrics_options,
    add_stop_option,
    broker_settings,
    load_spec,
    metrics_address,
    stop_timeout,
    topics,
)


def register(sub: Any) -> None:
    """Add the ``combiner`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "combiner",
        help="run a pipeline combiner partition (phase two: merge, close windows, confirm)",
        description="Merge partial aggregates of one key partition, close windows on the "
        "watermark, publish results, checkpoint state and confirm batches to gateways. "
        "Without --pipeline, join the combiner pool: host the partitions of every pipeline "
        "deployed with `shoal pipeline deploy` that this member owns (exactly one live "
        "member owns each; a dead member's partitions are taken over by the others, which "
        "must share --state-dir). Open state is capped by the spec's [limits] "
        "max_state_cells (unset: a quarter of the memory the combiner may use, the "
        "machine's RAM or its container's limit if lower, at 300 bytes a cell; `shoal bench "
        "memory` gives the bytes a cell costs): a partial that would pass it is refused "
        "whole, dead-lettered with reason state_cap_exceeded and counted in "
        "partials_over_cap.",
    )
    parser.add_argument(
        "--pipeline",
        default=None,
        metavar="NAME|FILE",
        help="run one partition of this pipeline: a TOML file, or the name of one in "
        "processors/ (default: join the pool and host every deployed pipeline)",
    )
    add_broker_options(parser)
    parser.add_argument(
        "--partition", type=int, default=0, help="partition index (default 0; with --pipeline)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="checkpoint folder (default: var/combiner/<pipeline>-<partition>); in the pool, "
        "the folder shared by every member, holding <pipeline>-<partition>/ (default: "
        "var/combiner)",
    )
    parser.add_argument(
        "--id", default="", help="pool member id (default: host name and pid; unique per member)"
    )
    parser.add_argument(
        "--no-key-topics",
        action="store_true",
        help="do not publish the retained per-key results/<pipeline>/<key> topics",
    )
    add_metrics_options(parser)
    add_stop_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one combiner partition, or a pool member, until signalled."""
    from shoal._stopping import run_until_signalled  # noqa: PLC0415
    from shoal.runtime.combiner import (  # noqa: PLC0415
        STATE_ROOT,
        CombinerConfig,
        CombinerRuntime,
        partition_state_dir,
    )

    address = metrics_address(args)
    if args.pipeline is None:
        return _run_pool(args, address)
    spec = load_spec(args.pipeline)
    if not 0 <= args.partition < spec.partitions:
        from shoal.errors import ConfigError  # noqa: PLC0415

        raise ConfigError(
            f"--partition {args.partition} is outside 0..{spec.partitions - 1} "
            f"(pipeline {spec.name!r} has {spec.partitions} partitions)"
        )
    state_dir = args.state_dir or partition_state_dir(STATE_ROOT, spec.name, args.partition)
    config = CombinerConfig(
        spec=spec,
        partition=args.partition,
        broker=broker_settings(args),
        topics=topics(args),
        state_dir=state_dir,
        per_key_results=not args.no_key_topics,
    )
    runtime = CombinerRuntime(config)
    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal.observe.collectors import CombinerCollector  # noqa: PLC0415

    main = exposed(runtime.run(), address, lambda: CombinerCollector(runtime), "shoal combiner")
    run_until_signalled(main, runtime.stop, "shoal combiner", grace_s=stop_timeout(args))
    return 0


def _run_pool(args: argparse.Namespace, address: tuple[str, int] | None) -> int:
    from shoal._stopping import run_until_signalled  # noqa: PLC0415
    from shoal.runtime.hosting import CombinerHost, HostConfig  # noqa: PLC0415

    config = HostConfig(
        broker=broker_settings(args), topics=topics(args), per_key_results=not args.no_key_topics
    )
    if args.state_dir is not None:
        config = replace(config, state_dir=args.state_dir)
    if args.id:
        config = replace(config, combiner_id=args.id)
    host = CombinerHost(config)
    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal.observe.collectors import CombinerPoolCollector  # noqa: PLC0415

    main = exposed(host.run(), address, lambda: CombinerPoolCollector(host), "shoal combiner")
    run_until_signalled(main, host.stop, "shoal combiner", grace_s=stop_timeout(args))
    return 0
