"""The embedded broker: ``mosquitto`` from PATH with a ``broker/`` profile on a free port.

Used by ``shoal broker``, ``shoal up``, the tests and the benchmarks. A profile is a template
(``broker/<profile>.conf``) whose ``${name}`` placeholders are filled in at start; a profile
that uses ``${acl_file}`` also gets ``broker/<profile>.acl`` rendered with one block per user
role (``shoal.broker.access``), and one that uses ``${tls_port}`` gets a TLS listener (with a
throwaway CA and server certificate when none is given).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import string
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, Self

from shoal._resources import resource_dir
from shoal.broker.access import BrokerUser, render_acl
from shoal.broker.certs import make_ca, make_certificate
from shoal.broker.mqtt import probe_broker
from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import BrokerError, BrokerNotFoundError, ConfigError
from shoal.schemas.topics import Topics

INSTALL_HINT: Final = (
    "mosquitto is not installed or not on PATH: install it with "
    "`sudo apt-get install -y mosquitto` (Debian/Ubuntu), `brew install mosquitto` (macOS), "
    "or run `make demo`/`make test`, which install it for you"
)
_START_ATTEMPTS: Final = 3
_ANY_ADDRESS: Final = frozenset({"0.0.0.0", "", "::"})  # noqa: S104 - recognised, not bound


class _ConfigTemplate(string.Template):
    """Only ``${name}`` is a placeholder, so ``$SYS`` in comments stays as written."""

    pattern = r"""
        \$(?:
            (?P<escaped>\$)
          | \{(?P<braced>[_a-z][_a-z0-9]*)\}
          | (?P<named>(?!x)x)
          | (?P<invalid>(?!x)x)
        )
    """  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The broker side of TLS.

    Attributes:
        cert_file: the broker's certificate (PEM).
        key_file: its private key.
        ca_file: the CA clients trust for it; also the CA client certificates must chain to.
        require_client_certificate: refuse clients without a certificate from ``ca_file``.
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    require_client_certificate: bool = False


def broker_profiles() -> list[str]:
    """Names of the profiles in ``broker/`` (``dev``, ``edge``, ...)."""
    return sorted(p.stem for p in resource_dir("broker").glob("*.conf"))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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
    ) -> None:
        self.profile = profile
        self.overrides = dict(overrides or {})
        self.bind = bind
        self._port = port
        self._fixed_port = port is not None
        self._own_dir = data_dir is None
        self.data_dir = (
            Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="shoal-broker-"))
        )
        self.users = _as_users(users)
        try:
            self.topics = Topics(root=topic_root)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._tls_port = tls_port
        self._fixed_tls_port = tls_port is not None
        self.tls_bind = tls_bind or bind
        self.tls = tls
        self.startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

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
        return "127.0.0.1" if self.bind in _ANY_ADDRESS else self.bind

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
        host = "127.0.0.1" if self.tls_bind in _ANY_ADDRESS else self.tls_bind
        return BrokerSettings(
            host=host, port=self.tls_port, tls=TlsSettings(ca_file=self.tls.ca_file)
        )

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
        return self._process.pid if self.running and self._process else None

    @property
    def running(self) -> bool:
        """Whether the mosquitto process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def config_path(self) -> Path:
        """The rendered configuration file."""
        return self.data_dir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        """Mosquitto's log file."""
        return self.data_dir / "mosquitto.log"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        """Start mosquitto and wait until it accepts connections.

        Raises:
            BrokerNotFoundError: no ``mosquitto`` on PATH.
            BrokerError: it exited or did not listen in time (the log tail is included).
        """
        if self.running:
            return self
        binary = shutil.which("mosquitto")
        if binary is None:
            raise BrokerNotFoundError(INSTALL_HINT)
        for attempt in range(_START_ATTEMPTS):
            if self._port is None or (attempt and not self._fixed_port):
                self._port = free_port(self.settings_host)
            if attempt and not self._fixed_tls_port:
                self._tls_port = None  # _render picks another one if the profile has TLS
            self._render()
            self.log_path.touch()
            log_offset = self.log_path.stat().st_size
            with self._stderr_path.open("wb") as stderr_file:
                self._process = subprocess.Popen(
                    [binary, "-c", str(self.config_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr_file,
                    start_new_session=True,  # a Ctrl-C in the terminal is ours to forward
                )
            if self._wait_listening():
                return self
            stderr = self._reap()
            tail = self._log_tail(log_offset) + stderr
            if "Address already in use" in tail and not self._fixed_port:
                continue
            raise BrokerError(
                f"mosquitto ({self.profile} profile) did not start on {self.bind}:{self._port}; "
                f"config {self.config_path}; last log lines:\n{tail.strip()}"
            )
        raise BrokerError(f"mosquitto could not find a free port after {_START_ATTEMPTS} attempts")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop mosquitto gracefully (SIGTERM: it saves its state), then SIGKILL if needed."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL mosquitto (a crash: state since the last autosave is lost)."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
        self._reap()

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
        self.users = _as_users(users)
        if not self.running or self._process is None:
            return
        self._write_passwords(self.password_path)
        if self.acl_path.exists():
            self._write_acl()
        self._process.send_signal(signal.SIGHUP)

    def close(self) -> None:
        """Stop and, if the data folder was temporary, remove it."""
        self.stop()
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

    def _render(self) -> None:
        template_path = resource_dir("broker") / f"{self.profile}.conf"
        if not template_path.is_file():
            available = ", ".join(broker_profiles())
            raise ConfigError(f"unknown broker profile {self.profile!r}; available: {available}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_passwords(self.password_path)
        template = template_path.read_text()
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
            self._write_acl()
        if "${tls_port}" in template:
            values.update(self._tls_values())
        try:
            text = _ConfigTemplate(template).substitute(values)
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"broker profile {template_path} has a bad placeholder: {exc}"
            ) from exc
        self.config_path.write_text(_override(text, self.overrides))

    def _tls_values(self) -> dict[str, str]:
        if self.tls is None:
            self.tls = _throwaway_tls(self.data_dir / "tls")
        if self._tls_port is None:
            self._tls_port = free_port(self.settings_host)
        return {
            "tls_port": str(self._tls_port),
            "tls_bind": self.tls_bind,
            "tls_ca_file": str(self.tls.ca_file),
            "tls_cert_file": str(self.tls.cert_file),
            "tls_key_file": str(self.tls.key_file),
            "tls_require_certificate": "true" if self.tls.require_client_certificate else "false",
        }

    def _write_acl(self) -> None:
        template_path = resource_dir("broker") / f"{self.profile}.acl"
        if not template_path.is_file():
            raise ConfigError(
                f"broker profile {self.profile!r} uses an ACL but {template_path} is missing"
            )
        values = {
            "root": self.topics.root or "(none)",
            "users": render_acl(self.users, self.topics),
        }
        try:
            text = _ConfigTemplate(template_path.read_text()).substitute(values)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"ACL template {template_path} has a bad placeholder: {exc}") from exc
        tmp = self.acl_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o600)
        tmp.replace(self.acl_path)

    def _write_passwords(self, path: Path) -> None:
        # Written beside the file and renamed, so a reloading broker never reads half of it.
        tmp = path.with_suffix(".tmp")
        tmp.write_text("")
        tmp.chmod(0o600)
        if self.users:
            tool = shutil.which("mosquitto_passwd")
            if tool is None:
                raise BrokerNotFoundError(
                    "mosquitto_passwd is not on PATH (it ships with the mosquitto package)"
                )
            for user in self.users:
                # -b takes the password on the command line; it lives for milliseconds and
                # only on this machine (mosquitto_passwd 2.0 cannot read it from stdin in batch).
                result = subprocess.run(
                    [tool, "-b", str(tmp), user.name, user.password],
                    capture_output=True,
                    check=False,
                )
                if result.returncode != 0:
                    raise BrokerError(
                        f"mosquitto_passwd failed for user {user.name!r}: "
                        f"{result.stderr.decode().strip()}"
                    )
        tmp.replace(path)

    def _wait_listening(self) -> bool:
        process = self._process
        assert process is not None
        step = 0.25
        waited = 0.0
        while waited < self.startup_timeout_s:
            if process.poll() is not None:
                return False
            if probe_broker(self.settings_host, self.port, step):
                return process.poll() is None
            waited += step
        process.kill()
        return False

    @property
    def _stderr_path(self) -> Path:
        return self.data_dir / "mosquitto.stderr"

    def _reap(self) -> str:
        process, self._process = self._process, None
        if process is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(1)
        try:
            return self._stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def _log_tail(self, offset: int, lines: int = 15) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(offset)
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) + "\n"


def _as_users(users: Mapping[str, str] | Iterable[BrokerUser] | None) -> list[BrokerUser]:
    if users is None:
        return []
    if isinstance(users, Mapping):
        return [BrokerUser(name, password) for name, password in users.items()]
    listed = list(users)
    names = [u.name for u in listed]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate broker user names in {names}")
    return listed


def _throwaway_tls(directory: Path) -> ServerTls:
    """A CA and a server certificate for this machine, made once per data folder."""
    ca_cert, cert, key = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    if not (ca_cert.exists() and cert.exists() and key.exists()):
        ca = make_ca(directory, "ca")
        files = make_certificate(ca, directory, "server")
        return ServerTls(files.cert_file, files.key_file, files.ca_file)
    return ServerTls(cert, key, ca_cert)


def _override(config: str, overrides: Mapping[str, str]) -> str:
    """``config`` with each option in ``overrides`` set to its value (replaced or added)."""
    for option, value in overrides.items():
        if not re.fullmatch(r"[a-z_]+", option) or "\n" in value:
            raise ConfigError(f"not a Mosquitto option: {option!r} {value!r}")
        line = f"{option} {value}"
        config, found = re.subn(rf"(?m)^{option}\s.*$", line, config)
        if not found:
            config = f"{config.rstrip()}\n{line}\n"
    return config
