"""``shoal worker``: one member of a pipeline's shared-subscription group."""

from __future__ import annotations

import argparse
from typing import Any

from shoal._cli.common import (
    add_broker_options,
    add_pipeline_option,
    broker_settings,
    load_spec,
    topics,
)


def register(sub: Any) -> None:
    """Add the ``worker`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "worker",
        help="run a pipeline worker (phase one: batches → partial aggregates)",
        description="Join $share/<pipeline>/..., decode batches, publish partial aggregates to "
        "the combiners, dead-letter bad input. SIGINT/SIGTERM drain it (it leaves the group "
        "without losing a batch); a second signal stops it at once.",
    )
    add_pipeline_option(parser)
    add_broker_options(parser)
    parser.add_argument("--id", default="", help="worker id / MQTT client id (default: unique)")
    parser.add_argument(
        "--receive-maximum",
        type=int,
        default=8,
        help="batches in flight to this worker (MQTT 5 Receive Maximum; default 8)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one worker until signalled."""
    from shoal._cli._run import run_until_signalled  # noqa: PLC0415
    from shoal.runtime.worker import Worker, WorkerConfig  # noqa: PLC0415

    config = WorkerConfig(
        spec=load_spec(args.pipeline),
        broker=broker_settings(args),
        topics=topics(args),
        worker_id=args.id,
        receive_maximum=args.receive_maximum,
    )
    worker = Worker(config)
    # SIGTERM/SIGINT drain (leave the group without losing anything); a second one cancels.
    run_until_signalled(worker.run(), worker.drain)
    return 0
