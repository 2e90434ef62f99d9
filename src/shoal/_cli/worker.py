"""``shoal worker``: a member of one pipeline's shared-subscription group, or of the pool."""

from __future__ import annotations

import argparse
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
    """Add the ``worker`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "worker",
        help="run a worker (phase one: batches → partial aggregates)",
        description="Without --pipeline, join the worker pool: serve every pipeline deployed "
        "with `shoal pipeline deploy` (one MQTT connection; pipelines are picked up as they "
        "are deployed, switched on update and dropped on delete, without a restart). With "
        "--pipeline, serve that one pipeline only (isolation). Either way: join "
        "$share/<pipeline>/<input>, decode batches, publish partial aggregates to the "
        "combiners, dead-letter bad input. SIGINT/SIGTERM drain it (it leaves every group "
        "without losing a batch); a second signal stops it at once.",
    )
    parser.add_argument(
        "--pipeline",
        default=None,
        metavar="NAME|FILE",
        help="serve only this pipeline: a TOML file, or the name of one in processors/ "
        "(default: join the pool and serve every deployed pipeline)",
    )
    add_broker_options(parser)
    parser.add_argument("--id", default="", help="worker id / MQTT client id (default: unique)")
    parser.add_argument(
        "--receive-maximum",
        type=int,
        default=8,
        help="batches in flight to this worker (MQTT 5 Receive Maximum; default 8)",
    )
    add_metrics_options(parser)
    add_stop_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one worker until signalled."""
    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal._stopping import run_until_signalled  # noqa: PLC0415
    from shoal.observe.collectors import WorkerCollector  # noqa: PLC0415
    from shoal.runtime.worker import Worker, WorkerConfig  # noqa: PLC0415

    address = metrics_address(args)
    config = WorkerConfig(
        spec=None if args.pipeline is None else load_spec(args.pipeline),
        broker=broker_settings(args),
        topics=topics(args),
        worker_id=args.id,
        receive_maximum=args.receive_maximum,
    )
    worker = Worker(config)
    # SIGTERM/SIGINT drain (leave the group without losing anything); a second one cancels.
    run_until_signalled(
        exposed(worker.run(), address, lambda: WorkerCollector(worker), "shoal worker"),
        worker.drain,
        "shoal worker",
        grace_s=stop_timeout(args),
    )
    return 0
