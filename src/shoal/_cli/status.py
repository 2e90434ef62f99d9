"""``shoal status``: a pipeline's workers, lag, and why its windows are (not) closing."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from shoal._cli.common import add_broker_options, broker_settings, load_spec, topics
from shoal.errors import ConfigError

if TYPE_CHECKING:
    from shoal.processors.spec import PipelineSpec

DOCUMENTS_TIMEOUT_S = 5.0


def register(sub: Any) -> None:
    """Add the ``status`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "status",
        help="show a pipeline's workers, lag and per-gateway event-time progress",
        description=(
            "Listen to a running pipeline's heartbeats and gateway announcements for a moment "
            "and show its workers, rates, lag, and per combiner partition why windows are "
            "(not) closing: which gateway holds the watermark, for how long it has kept the "
            "others waiting, which gateways were released from holding (clock far behind), "
            "how many of their batches were refused, and each gateway's clock offset. Exit 1 "
            "if no combiner of the pipeline reported within --wait."
        ),
    )
    parser.add_argument(
        "--pipeline",
        default="default",
        metavar="NAME|FILE",
        help=(
            "the pipeline: a name deployed at run time (`shoal pipeline list`), else one in "
            "processors/, or a TOML file (default: default)"
        ),
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=2.5,
        metavar="SECONDS",
        help="how long to listen (heartbeats come every second; default 2.5)",
    )
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    add_broker_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Listen for ``--wait`` seconds, then print the status."""
    from shoal.broker import AsyncSession, unique_client_id  # noqa: PLC0415
    from shoal.clock import SystemClock  # noqa: PLC0415
    from shoal.scaler.monitor import PipelineMonitor  # noqa: PLC0415
    from shoal.view.status import format_status, pipeline_status  # noqa: PLC0415

    spec = _spec(args)
    monitor = PipelineMonitor(spec, topics(args), SystemClock())
    settings = broker_settings(args)

    async def listen() -> None:
        async with AsyncSession(settings, unique_client_id("shoal-status")) as session:
            await session.subscribe(monitor.filters(), qos=0)
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(args.wait, stop.set)
            async for message in session.messages_until(stop):
                monitor.on_message(message)

    asyncio.run(listen())
    status = pipeline_status(spec.name, monitor.snapshot(), args.wait)
    if args.json:
        sys.stdout.write(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_status(status))
    if not status["partitions"]:
        print(
            f"shoal status: no combiner of pipeline {spec.name!r} reported within {args.wait:g} s "
            f"on {settings.url}; is it running?",
            file=sys.stderr,
        )
        return 1
    return 0


def _spec(args: argparse.Namespace) -> PipelineSpec:
    """The pipeline to watch: a TOML file, else the deployed one of that name, else processors/.

    A deployed pipeline is what runs under its name, so it comes before a file of the same
    name in processors/; an alias is watched as the computation it shares.
    """
    from shoal.control.canonical import canonicalize  # noqa: PLC0415
    from shoal.control.client import ControlClient  # noqa: PLC0415

    if Path(args.pipeline).suffix == ".toml" or Path(args.pipeline).exists():
        return load_spec(args.pipeline)
    client = ControlClient(broker_settings(args), topics(args), timeout_s=DOCUMENTS_TIMEOUT_S)
    documents = {d.name: d for d in asyncio.run(client.documents())}
    document = documents.get(args.pipeline)
    if document is not None and document.alias_of is not None:
        document = documents.get(document.alias_of)
    if document is None or document.spec is None:
        try:
            return load_spec(args.pipeline)  # not deployed: by name in processors/
        except ConfigError as exc:
            deployed = sorted(name for name, d in documents.items() if d.named)
            raise ConfigError(f"{exc}; deployed: {', '.join(deployed) or 'none'}") from exc
    return canonicalize(document.spec).spec
