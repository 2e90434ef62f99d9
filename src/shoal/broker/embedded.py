"""The embedded broker: ``mosquitto`` from PATH with a ``broker/`` profile on a free port.

Used by ``shoal broker``, ``shoal up``, the tests and the benchmarks. The profile's files are
written by ``shoal.broker.profiles`` (a TLS listener gets a throwaway CA and server
certificate when none is given); this module runs, restarts and stops the process. With
``websockets=True`` browsers reach it over MQTT/WebSockets too (``shoal.broker.websocket``):
Mosquitto's own listener when the binary has one (dev profile), otherwise shoal's bridge.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

from shoal.broker._mochi import MochiProcess, mochi_binary, mochi_config, write_mochi_config
from shoal.broker._mosquitto import MosquittoProcess, mosquitto_binary
from shoal.broker.access import BrokerUser
from shoal.broker.probe import free_port
from shoal.broker.profiles import (
    ServerTls,
    as_users,
    fill,
    override,
    profile_template,
    throwaway_tls,
    tls_values,
    write_acl,
    write_passwords,
    ws_listener,
)
from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import BrokerError, ConfigError
from shoal.schemas.topics import Topics

if TYPE_CHECKING:
    from shoal.broker.websocket import WebSocketBridge

_START_ATTEMPTS: Final = 3
MOCHI_STORE_LOAD_S: Final = 60.0
"""How long a Mochi broker restarted on a store may take to listen: it reads the whole store
(one JSON record per queued message) first; a chaos run's 400 MB backlog took 15 s at load
average 12, past the usual start-up wait (docs/brokers.md)."""
BROKERS: Final = ("mosquitto", "mochi")
BROKER_ENV: Final = "SHOAL_EMBEDDED_BROKER"


def default_broker() -> str:
    """The broker ``EmbeddedBroker`` runs: ``$SHOAL_EMBEDDED_BROKER``, else mosquitto.

    Raises:
        ConfigError: the variable names another.
    """
    return check_broker(os.environ.get(BROKER_ENV) or "mosquitto")


def check_broker(name: str) -> str:
    """``name`` if it is a broker shoal can embed (``BROKERS``).

    Raises:
        ConfigError: it is not.
    """
    if name not in BROKERS:
        raise ConfigError(f"unknown broker {name!r}; shoal embeds {' or '.join(BROKERS)}")
    return name


_ANY_ADDRESS: Final = frozenset({"0.0.0.0", "", "::"})  # noqa: S104 - recognised, not bound


def _dial_host(bind: str) -> str:
    """The address a client dials for a listener on ``bind`` (loopback for all interfaces)."""
    return "127.0.0.1" if bind in _ANY_ADDRESS else bind


class EmbeddedBroker:
    """A Mosquitto subprocess with a config rendered from a ``broker/`` profile.

    Args:
        profile: name of a ``broker/<profile>.conf`` template.
        port: TCP port; None picks a free one (kept across restarts).
        bind: listen address.
        data_dir: persistence, config and log folder; None makes a temporary one that
            ``close`` removes. Keep it to restart a broker with its persisted state.
        users: ``BrokerUser`` values (name, password, role), or a mapping of user name →
            password (users without a role); passwords are written hashed with
            ``mosquitto_passwd``. Profiles that deny anonymous access need at least one.
        topic_root: the topic root the ACL's rules sit below (``Topics.root``).
        tls_port: port of the TLS listener in profiles that have one; None picks a free one.
        tls_bind: its listen address (None: the same as ``bind``); e.g. ``0.0.0.0`` for TLS
            from other machines while the plain listener stays on loopback.
        tls: the TLS listener's files; None (in a profile with TLS) makes a throwaway CA and
            server certificate in ``data_dir/tls``.
        startup_timeout_s: how long to wait for the listener.
        overrides: Mosquitto options that replace the profile's (or are added), e.g.
            ``{"max_queued_bytes": "8388608"}`` for a test that needs a small queue.
        websockets: serve MQTT over WebSockets for browsers (``ws_url``): dev, plain on
            ``bind``; secure, TLS on ``tls_bind`` with the TLS listener's certificate, for
            users of the dashboard role only (always shoal's bridge, which checks the role).
        ws_port: its port; None picks a free one.
        broker: ``mosquitto`` or ``mochi`` (Mochi MQTT, ``shoal.broker._mochi``: the profile is
            translated); None: ``$SHOAL_EMBEDDED_BROKER``, else mosquitto. See docs/brokers.md.

    Example::

        with EmbeddedBroker() as broker:
            settings = broker.settings   # BrokerSettings(host="127.0.0.1", port=...)
    """

    def __init__(
        self,
        profile: str = "dev",
        *,
        port: int | None = None,
        bind: str = "127.0.0.1",
        data_dir: Path | None = None,
        users: Mapping[str, str] | Iterable[BrokerUser] | None = None,
        topic_root: str = "",
        tls_port: int | None = None,
        tls_bind: str | None = None,
        tls: ServerTls | None = None,
        startup_timeout_s: float = 10.0,
        overrides: Mapping[str, str] | None = None,
        websockets: bool = False,
        ws_port: int | None = None,
        broker: str | None = None,
    ) -> None:
        self.broker = default_broker() if broker is None else check_broker(broker)
        self.profile = profile
        self.websockets = websockets
        self._ws_port = ws_port
        self._native_ws = False
        self._bridge: WebSocketBridge | None = None
        self.overrides = dict(overrides or {})
        self.bind = bind
        self._port = port
        self._fixed_port = port is not None
        self._own_dir = data_dir is None
        self.data_dir = (
            Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="shoal-broker-"))
        )
        self.users = as_users(users)
        self.topics = Topics(root=topic_root)  # a bad root raises TopicError, a ConfigError
        self._tls_port = tls_port
        self._fixed_tls_port = tls_port is not None
        self.tls_bind = tls_bind or bind
        self.tls = tls
        self.startup_timeout_s = startup_timeout_s
        self._process: MosquittoProcess | None = None

    # -- properties ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The listener port (assigned at first start)."""
        if self._port is None:
            raise BrokerError("the broker has not been started yet")
        return self._port

    @property
    def settings_host(self) -> str:
        """The address clients dial (loopback when listening on all interfaces)."""
        return _dial_host(self.bind)

    @property
    def settings(self) -> BrokerSettings:
        """How clients reach this broker."""
        return BrokerSettings(host=self.settings_host, port=self.port)

    @property
    def tls_port(self) -> int:
        """The TLS listener's port (profiles with TLS, once started)."""
        if self._tls_port is None:
            raise BrokerError(
                f"the {self.profile} profile has no TLS listener, or it has not started"
            )
        return self._tls_port

    @property
    def tls_settings(self) -> BrokerSettings:
        """How clients reach the TLS listener, trusting the broker's CA."""
        if self.tls is None:
            raise BrokerError(
                f"the {self.profile} profile has no TLS listener, or it has not started"
            )
        return BrokerSettings(
            host=_dial_host(self.tls_bind),
            port=self.tls_port,
            tls=TlsSettings(ca_file=self.tls.ca_file),
        )

    @property
    def ws_url(self) -> str:
        """``ws://host:port`` (or ``wss://`` in the secure profile) for browsers, once started."""
        if not self.websockets or self._ws_port is None:
            raise BrokerError("the broker serves no WebSockets (websockets=False), or is not up")
        secure = self._secure_ws
        host = _dial_host(self.tls_bind if secure else self.bind)
        return f"{'wss' if secure else 'ws'}://{host}:{self._ws_port}"

    @property
    def ws_bridged(self) -> bool:
        """Whether browsers go through shoal's bridge (not Mosquitto's own listener)."""
        return self._bridge is not None

    @property
    def acl_path(self) -> Path:
        """The rendered ACL file (profiles with access control)."""
        return self.data_dir / "acl"

    @property
    def password_path(self) -> Path:
        """The password file (hashed passwords)."""
        return self.data_dir / "passwd"

    @property
    def pid(self) -> int | None:
        """PID of the running mosquitto, if any."""
        return self._process.pid if self._process is not None and self.running else None

    @property
    def running(self) -> bool:
        """Whether the mosquitto process is alive."""
        return self._process is not None and self._process.alive()

    @property
    def config_path(self) -> Path:
        """The rendered configuration file."""
        return self.data_dir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        """The broker's log file."""
        return self.data_dir / f"{self.broker}.log"

    @property
    def mochi_config_path(self) -> Path:
        """The Mochi configuration translated from ``config_path`` (``broker="mochi"``)."""
        return self.data_dir / "mochi.json"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        """Start mosquitto and wait until it accepts connections.

        Raises:
            BrokerNotFoundError: no ``mosquitto`` on PATH.
            BrokerError: it exited or did not listen in time (the log tail is included).
        """
        if self.running:
            return self
        binary = mochi_binary() if self.broker == "mochi" else mosquitto_binary()
        for attempt in range(_START_ATTEMPTS):
            if self._port is None or (attempt and not self._fixed_port):
                self._port = free_port(self.settings_host)
            if attempt and not self._fixed_tls_port:
                self._tls_port = None  # _render picks another one if the profile has TLS
            self._render()
            process = self._process = self._spawn(binary)
            if process.wait_listening(self.settings_host, self.port, self.listen_timeout_s()):
                try:
                    self._start_bridge()
                except BrokerError:
                    self.stop()  # no mosquitto left behind by a failed start
                    raise
                return self
            self._process = None
            stderr = process.reap()
            tail = process.log_tail() + stderr
            if "address already in use" in tail.lower() and not self._fixed_port:
                continue
            raise BrokerError(
                f"{self.broker} ({self.profile} profile) did not start on "
                f"{self.bind}:{self._port}; config {self.config_path}; "
                f"last log lines:\n{tail.strip()}"
            )
        raise BrokerError(
            f"{self.broker} could not find a free port after {_START_ATTEMPTS} attempts"
        )

    def listen_timeout_s(self) -> float:
        """How long ``start`` waits for the listener: longer for Mochi on an existing store."""
        store = self.data_dir / "mochi.db"
        if self.broker == "mochi" and store.exists() and store.stat().st_size > 0:
            return max(self.startup_timeout_s, MOCHI_STORE_LOAD_S)
        return self.startup_timeout_s

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop mosquitto gracefully (SIGTERM: it saves its state), then SIGKILL if needed."""
        process, self._process = self._process, None
        if process is not None:
            process.terminate(timeout_s)
            process.reap()

    def kill(self) -> None:
        """SIGKILL mosquitto (a crash: state since the last autosave is lost)."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.reap()

    def restart(self) -> Self:
        """Start again on the same port with the same persisted state."""
        self.stop()
        self._fixed_port = True
        self._fixed_tls_port = self._tls_port is not None
        return self.start()

    def set_users(self, users: Mapping[str, str] | Iterable[BrokerUser]) -> None:
        """Replace the users; a running broker reloads its password and ACL files (SIGHUP).

        Connected clients keep their sessions; the new ACL applies to their next message.
        """
        self.users = as_users(users)
        if not self.running or self._process is None:
            return
        write_passwords(self.password_path, self.users)
        if self._bridge is not None and self._bridge.allowed_users is not None:
            self._bridge.allowed_users = self._dashboard_users()
        if self.acl_path.exists():
            write_acl(self.acl_path, self.profile, self.users, self.topics)
        if self.broker == "mochi":
            self._write_mochi_config()
        self._process.reload()

    def close(self) -> None:
        """Stop (the WebSocket bridge too) and, if the data folder was temporary, remove it."""
        self.stop()
        bridge, self._bridge = self._bridge, None
        if bridge is not None:
            bridge.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _spawn(self, binary: str) -> MosquittoProcess:
        if self.broker == "mochi":
            self._write_mochi_config()
            return MochiProcess(
                binary, self.mochi_config_path, self.data_dir / "mochi.stderr", self.log_path
            )
        return MosquittoProcess(
            binary, self.config_path, self.data_dir / "mosquitto.stderr", self.log_path
        )

    def _write_mochi_config(self) -> None:
        config = mochi_config(
            self.config_path.read_text(), self.users, self.topics, self.data_dir, self.log_path
        )
        write_mochi_config(self.mochi_config_path, config)

    def _render(self) -> None:
        source, template = profile_template(self.profile)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        write_passwords(self.password_path, self.users)
        values = {
            "port": str(self._port),
            "bind": self.bind,
            "data_dir": str(self.data_dir),
            "log_file": str(self.log_path),
            "password_file": str(self.password_path),
            "acl_file": str(self.acl_path),
            # Started as root, mosquitto switches to this user; keep it the one who owns
            # the data folder (otherwise it cannot write its log or read the passwords).
            "user": pwd.getpwuid(os.getuid()).pw_name,
        }
        if "${acl_file}" in template:
            write_acl(self.acl_path, self.profile, self.users, self.topics)
        if "${tls_port}" in template:
            if self.tls is None:
                self.tls = throwaway_tls(self.data_dir / "tls")
            if self._tls_port is None:
                self._tls_port = free_port(self.settings_host)
            values.update(tls_values(self.tls, self._tls_port, self.tls_bind))
        config = override(fill(template, values, source), self.overrides)
        if self.websockets:
            # Only a broker that serves WebSockets loads the websockets library (~6 MB of
            # every process that imports shoal.broker: workers and combiners never need it).
            from shoal.broker.websocket import mosquitto_has_websockets  # noqa: PLC0415

            if self._ws_port is None:
                self._ws_port = free_port(self.settings_host)
            # Mosquitto's own listener only where no role check is needed (no ACL).
            self._native_ws = (
                self.broker == "mosquitto"
                and not self._secure_ws
                and mosquitto_has_websockets(mosquitto_binary())
            )
            if self._native_ws:
                config += ws_listener(self._ws_port, self.bind)
        self.config_path.write_text(config)

    @property
    def _secure_ws(self) -> bool:
        return self.tls is not None or "${acl_file}" in profile_template(self.profile)[1]

    def _dashboard_users(self) -> frozenset[str]:
        return frozenset(
            u.name for u in self.users if u.role is not None and u.role.kind == "dashboard"
        )

    def _start_bridge(self) -> None:
        """Start shoal's WebSocket bridge once (it outlives restarts of mosquitto)."""
        if not self.websockets or self._native_ws or self._bridge is not None:
            return
        assert self._ws_port is not None  # chosen by _render
        from shoal.broker.websocket import WebSocketBridge, server_tls  # noqa: PLC0415

        secure = self._secure_ws
        tls = self.tls if secure else None
        self._bridge = WebSocketBridge(
            self.settings_host,
            self.port,
            bind=self.tls_bind if secure else self.bind,
            port=self._ws_port,
            tls=None if tls is None else server_tls(tls.cert_file, tls.key_file),
            allowed_users=self._dashboard_users() if secure else None,
        ).start()
