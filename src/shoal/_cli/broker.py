"""``shoal broker``: run the embedded Mosquitto in the foreground."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

from shoal.broker.embedded import EmbeddedBroker, broker_profiles


def register(sub: Any) -> None:
    """Add the ``broker`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "broker",
        help="run Mosquitto with a shoal profile",
        description="Start mosquitto from PATH with a profile from broker/ and keep it running "
        "until Ctrl-C.",
    )
    parser.add_argument(
        "--profile", default="dev", help=f"broker profile ({', '.join(broker_profiles())})"
    )
    parser.add_argument("--port", type=int, default=1883, help="listener port (0: a free one)")
    parser.add_argument("--bind", default="127.0.0.1", help="listen address")
    parser.add_argument(
        "--data-dir", type=Path, help="persistence folder (default: a temporary folder)"
    )
    parser.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="NAME:PASSWORD",
        help="add a user to the password file (repeatable; needed by profiles without anonymous)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Start the broker and wait for Ctrl-C or SIGTERM."""
    users = dict(entry.split(":", 1) for entry in args.user)
    broker = EmbeddedBroker(
        args.profile,
        port=args.port or None,
        bind=args.bind,
        data_dir=args.data_dir,
        users=users,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with broker:
        print(f"shoal broker: {args.profile} profile listening on {broker.settings.url}")
        print(f"  config {broker.config_path}\n  log    {broker.log_path}\n  Ctrl-C to stop")
        try:
            while not stop.wait(1.0):
                if not broker.running:
                    print(f"shoal broker: mosquitto exited; see {broker.log_path}")
                    return 1
        except KeyboardInterrupt:
            pass
    return 0
