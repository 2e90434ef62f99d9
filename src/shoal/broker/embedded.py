"""The embedded broker: ``mosquitto`` from PATH with a ``broker/`` profile on a free port.

Used by ``shoal broker``, ``shoal up``, the tests and the benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import string
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Final, Self

from shoal._resources import resource_dir
from shoal.broker.mqtt import probe_broker
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError, BrokerNotFoundError, ConfigError

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
        users: user name → password, written hashed with ``mosquitto_passwd`` (profiles that
            deny anonymous access need at least one).
        startup_timeout_s: how long to wait for the listener.

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
        users: Mapping[str, str] | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.profile = profile
        self.bind = bind
        self._port = port
        self._fixed_port = port is not None
        self._own_dir = data_dir is None
        self.data_dir = (
            Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="shoal-broker-"))
        )
        self.users = dict(users or {})
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
        return self.start()

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
        password_file = self.data_dir / "passwd"
        self._write_passwords(password_file)
        values = {
            "port": str(self._port),
            "bind": self.bind,
            "data_dir": str(self.data_dir),
            "log_file": str(self.log_path),
            "password_file": str(password_file),
            # Started as root, mosquitto switches to this user; keep it the one who owns
            # the data folder (otherwise it cannot write its log or read the passwords).
            "user": pwd.getpwuid(os.getuid()).pw_name,
        }
        try:
            text = _ConfigTemplate(template_path.read_text()).substitute(values)
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"broker profile {template_path} has a bad placeholder: {exc}"
            ) from exc
        self.config_path.write_text(text)

    def _write_passwords(self, path: Path) -> None:
        path.write_text("")
        path.chmod(0o600)
        if not self.users:
            return
        tool = shutil.which("mosquitto_passwd")
        if tool is None:
            raise BrokerNotFoundError(
                "mosquitto_passwd is not on PATH (it ships with the mosquitto package)"
            )
        for user, password in self.users.items():
            result = subprocess.run(
                [tool, "-b", str(path), user, password], capture_output=True, check=False
            )
            if result.returncode != 0:
                raise BrokerError(
                    f"mosquitto_passwd failed for user {user!r}: {result.stderr.decode().strip()}"
                )

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
