"""``shoal broker``: run the embedded Mosquitto in the foreground."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import tomllib
from pathlib import Path
from typing import Any

from shoal._cli.common import add_embedded_broker_option
from shoal.broker.access import BrokerUser, Role, users_from_config
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.profiles import ServerTls, broker_profiles
from shoal.errors import ConfigError

DEFAULT_WS_PORT = 9001


def register(sub: Any) -> None:
    """Add the ``broker`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "broker",
        help="run Mosquitto with a shoal profile",
        description="Start mosquitto from PATH with a profile from broker/ and keep it running "
        "until Ctrl-C. The secure profile needs users with roles (--users-file) and serves "
        "TLS too; SIGHUP re-reads the users file without a restart.",
    )
    parser.add_argument(
        "--profile", default="dev", help=f"broker profile ({', '.join(broker_profiles())})"
    )
    parser.add_argument("--port", type=int, default=1883, help="listener port (0: a free one)")
    parser.add_argument("--bind", default="127.0.0.1", help="listen address")
    parser.add_argument(
        "--data-dir", type=Path, help="persistence folder (default: a temporary folder)"
    )
    add_embedded_broker_option(parser)
    access = parser.add_argument_group("users and access (edge and secure profiles)")
    access.add_argument(
        "--users-file",
        type=Path,
        metavar="FILE",
        help="TOML file of [[users]] with name, role and password/password_env/password_file",
    )
    access.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="NAME:PASSWORD[:ROLE]",
        help="add a user (repeatable); ROLE is gateway, worker:PIPELINE, combiner:PIPELINE, "
        "dashboard[:PIPELINE] or admin. Prefer --users-file: a command line is visible to "
        "every user of the machine",
    )
    access.add_argument(
        "--topic-root", default="", metavar="PREFIX", help="topic root the ACL rules sit below"
    )
    parser.add_argument(
        "--ws-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"MQTT over WebSockets for browsers (shoal view): default {DEFAULT_WS_PORT} (a free "
        "one if it is taken), 0 a free one, -1 none; TLS and dashboard users only in the "
        "secure profile",
    )
    tls = parser.add_argument_group("TLS listener (secure profile)")
    tls.add_argument("--tls-port", type=int, default=8883, help="TLS listener port (0: a free one)")
    tls.add_argument(
        "--tls-bind", metavar="ADDRESS", help="TLS listen address (default: the same as --bind)"
    )
    tls.add_argument("--certfile", type=Path, help="the broker's certificate (PEM)")
    tls.add_argument("--keyfile", type=Path, help="its private key")
    tls.add_argument(
        "--cafile", type=Path, help="CA of the broker's certificate (and of client certificates)"
    )
    tls.add_argument(
        "--require-client-cert",
        action="store_true",
        help="refuse TLS clients without a certificate signed by --cafile",
    )
    parser.set_defaults(run=run)


def _users(args: argparse.Namespace) -> list[BrokerUser]:
    users = []
    if args.users_file is not None:
        try:
            data = tomllib.loads(args.users_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read the users file {args.users_file}: {exc}") from exc
        users += users_from_config(data.get("users", []), os.environ, args.users_file.parent)
    for entry in args.user:
        name, sep, rest = entry.partition(":")
        if not sep:
            raise ConfigError(f"--user {entry!r}: write NAME:PASSWORD[:ROLE]")
        password, _, role = rest.partition(":")
        users.append(BrokerUser(name, password, Role.parse(role) if role else None))
    return users


def _server_tls(args: argparse.Namespace) -> ServerTls | None:
    files = (args.certfile, args.keyfile, args.cafile)
    if not any(files):
        if args.require_client_cert:
            raise ConfigError("--require-client-cert needs --cafile (and --certfile, --keyfile)")
        return None  # a profile with TLS makes a throwaway CA and certificate
    if not all(files):
        raise ConfigError("give --certfile, --keyfile and --cafile together")
    return ServerTls(args.certfile, args.keyfile, args.cafile, args.require_client_cert)


def _ws_port(asked: int | None) -> int | None:
    """The WebSocket port to listen on (None: a free one)."""
    if asked is not None:
        return asked if asked > 0 else None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", DEFAULT_WS_PORT))  # noqa: S104 - free on every address?
        except OSError:
            return None
    return DEFAULT_WS_PORT


def run(args: argparse.Namespace) -> int:
    """Start the broker and wait for Ctrl-C or SIGTERM (SIGHUP reloads the users)."""
    broker = EmbeddedBroker(
        args.profile,
        port=args.port or None,
        bind=args.bind,
        data_dir=args.data_dir,
        users=_users(args),
        topic_root=args.topic_root,
        tls_port=args.tls_port or None,
        tls_bind=args.tls_bind,
        tls=_server_tls(args),
        websockets=args.ws_port is None or args.ws_port >= 0,
        ws_port=_ws_port(args.ws_port),
    )
    stop = threading.Event()
    reload = threading.Event()
    # SIGINT too, not left to KeyboardInterrupt: a shell that starts a command in the
    # background without job control starts it with SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler (`shoal broker &` in a script would not stop on SIGINT).
    for stopping in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stopping, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    with broker:
        print(f"shoal broker: {args.profile} profile listening on {broker.settings.url}")
        if broker.tls is not None:
            print(f"  TLS    {broker.tls_settings.url} (clients trust {broker.tls.ca_file})")
        if broker.websockets:
            print(f"  WebSockets {broker.ws_url} (the page: shoal view --ws-url {broker.ws_url})")
        if broker.acl_path.exists():
            print(f"  ACL    {broker.acl_path} ({len(broker.users)} user(s))")
        print(f"  config {broker.config_path}\n  log    {broker.log_path}\n  Ctrl-C to stop")
        while not stop.wait(1.0):
            if reload.is_set():
                reload.clear()
                _reload(broker, args)
            if not broker.running:
                print(f"shoal broker: mosquitto exited; see {broker.log_path}")
                return 1
    return 0


def _reload(broker: EmbeddedBroker, args: argparse.Namespace) -> None:
    try:
        broker.set_users(_users(args))
    except ConfigError as exc:
        print(f"shoal broker: users not reloaded: {exc}")
        return
    print(f"shoal broker: reloaded {len(broker.users)} user(s)")
