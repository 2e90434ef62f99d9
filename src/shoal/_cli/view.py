"""``shoal view``: serve the dashboard page for a running broker."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from shoal._cli.common import add_broker_options, broker_settings, topics
from shoal.errors import ConfigError

DEFAULT_PORT = 8580


def register(sub: Any) -> None:
    """Add the ``view`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "view",
        help="serve a live dashboard page (MQTT over WebSockets in the browser)",
        description="Serve a web page that connects to the broker over MQTT/WebSockets and "
        "shows deployed pipelines, latest results per key with charts, corrections, alerts, "
        "workers and lag, gateways' watermarks and clock offsets, dead letters and late rows. "
        "Without --ws-url, shoal view bridges WebSockets to the --broker's MQTT listener "
        "itself (the broker still checks every browser's credentials and ACL). Works offline: "
        "its JavaScript is served from this machine.",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"page port (default {DEFAULT_PORT})"
    )
    parser.add_argument("--bind", default="127.0.0.1", help="page (and bridge) listen address")
    parser.add_argument(
        "--ws-url",
        metavar="URL",
        help="the broker's MQTT-over-WebSockets endpoint (ws:// or wss://, as `shoal broker` "
        "prints it) instead of a bridge started here",
    )
    parser.add_argument(
        "--login",
        action="store_true",
        help="ask for a user name and password in the page (implied by a wss:// --ws-url)",
    )
    add_broker_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C or SIGTERM."""
    from shoal.broker.websocket import WebSocketBridge  # noqa: PLC0415
    from shoal.view.server import PageConfig, ViewServer  # noqa: PLC0415

    root = topics(args).root
    bridge = None
    if args.ws_url:
        ws_url = args.ws_url
    else:
        settings = broker_settings(args)
        if settings.tls is not None:
            raise ConfigError(
                "shoal view bridges to a plain MQTT listener: point --broker at one (mqtt://), "
                "or give the broker's own WebSocket endpoint with --ws-url"
            )
        bridge = WebSocketBridge(settings.host, settings.port, bind=args.bind).start()
        ws_url = bridge.url
    login = args.login or ws_url.startswith("wss://")
    stop = threading.Event()
    for stopping in (signal.SIGINT, signal.SIGTERM):  # SIGINT: see `shoal broker`
        signal.signal(stopping, lambda *_: stop.set())
    try:
        with ViewServer(
            PageConfig(ws_url=ws_url, login=login, root=root, username=args.username or ""),
            bind=args.bind,
            port=args.port,
        ) as view:
            print(f"shoal view: {view.url} (broker over WebSockets: {ws_url})", flush=True)
            while not stop.wait(1.0):
                pass
    finally:
        if bridge is not None:
            bridge.stop()
    return 0
