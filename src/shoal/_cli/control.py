"""``shoal control``: the control plane that stores pipelines deployed at run time."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from shoal._cli.common import (
    add_broker_options,
    add_metrics_options,
    add_stop_option,
    broker_settings,
    metrics_address,
    stop_timeout,
    topics,
)


def register(sub: Any) -> None:
    """Add the ``control`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "control",
        help="run the control plane that answers `shoal pipeline` requests",
        description=(
            "Answer `shoal pipeline deploy/update/delete` requests and keep every deployed "
            "pipeline as a retained, versioned document on shoal/pipelines/<name>. Restores "
            "its state from those documents when it starts; run exactly one per deployment. "
            "In the secure profile its user needs the `control` role."
        ),
    )
    add_broker_options(parser)
    add_metrics_options(parser)
    add_stop_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM."""
    from shoal._stopping import run_until_signalled  # noqa: PLC0415
    from shoal.clock import SystemClock  # noqa: PLC0415
    from shoal.control.service import ControlPlane, serve  # noqa: PLC0415

    address = metrics_address(args)
    plane = ControlPlane(broker_settings(args), topics(args), SystemClock())
    stop = asyncio.Event()
    main = serve(plane, stop, lambda: print("shoal control: ready", flush=True))
    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal.observe.collectors import ControlCollector  # noqa: PLC0415

    run_until_signalled(
        exposed(main, address, lambda: ControlCollector(plane), "shoal control"),
        stop.set,
        "shoal control",
        grace_s=stop_timeout(args),
    )
    return 0
