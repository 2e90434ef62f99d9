"""One run of the ``mosquitto`` binary: spawn it, wait for its listener, stop it, read its log.

``EmbeddedBroker`` owns the configuration and restarts; this module only handles a process.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Final

from shoal._spawn import spawn_tied
from shoal.broker.probe import probe_broker
from shoal.errors import BrokerNotFoundError

INSTALL_HINT: Final = (
    "mosquitto is not installed or not on PATH: install it with "
    "`sudo apt-get install -y mosquitto` (Debian/Ubuntu), `brew install mosquitto` (macOS), "
    "or run `make demo`/`make test`, which install it for you"
)


def mosquitto_binary() -> str:
    """The ``mosquitto`` on PATH.

    Raises:
        BrokerNotFoundError: there is none.
    """
    binary = shutil.which("mosquitto")
    if binary is None:
        raise BrokerNotFoundError(INSTALL_HINT)
    return binary


class MosquittoProcess:
    """``mosquitto -c config``, started at once, with stderr kept in ``stderr_path``.

    Args:
        binary: the mosquitto executable.
        config_path: its configuration file.
        stderr_path: where its stderr goes (read back by ``reap``).
        log_path: the log file its configuration names (read by ``log_tail``).
    """

    def __init__(self, binary: str, config_path: Path, stderr_path: Path, log_path: Path) -> None:
        self.stderr_path = stderr_path
        self.log_path = log_path
        log_path.touch()
        self.log_offset = log_path.stat().st_size
        with stderr_path.open("wb") as stderr_file:
            self._popen = spawn_tied(
                self._argv(binary, config_path),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr_file,
                # A Ctrl-C in the terminal is ours to forward; our death (even SIGKILL) its SIGTERM.
                start_new_session=True,
            )

    def _argv(self, binary: str, config_path: Path) -> list[str]:
        return [binary, "-c", str(config_path)]

    @property
    def pid(self) -> int:
        """The process id."""
        return self._popen.pid

    def alive(self) -> bool:
        """Whether it is still running."""
        return self._popen.poll() is None

    def wait_listening(self, host: str, port: int, timeout_s: float) -> bool:
        """Wait until it answers MQTT on host:port; False (and killed) if it exits or is late."""
        step = 0.25
        waited = 0.0
        while waited < timeout_s:
            if not self.alive():
                return False
            if probe_broker(host, port, step):
                return self.alive()
            waited += step
        self._popen.kill()
        return False

    def terminate(self, timeout_s: float) -> None:
        """SIGTERM (it saves its state), then SIGKILL after ``timeout_s``."""
        if self.alive():
            self._popen.terminate()
            try:
                self._popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()

    def kill(self) -> None:
        """SIGKILL (a crash: state since the last autosave is lost)."""
        if self.alive():
            self._popen.send_signal(signal.SIGKILL)
            self._popen.wait()

    def reload(self) -> None:
        """SIGHUP: reread the password and ACL files."""
        self._popen.send_signal(signal.SIGHUP)

    def reap(self) -> str:
        """Wait briefly for the exit; what it wrote to stderr."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(1)
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        """The last lines it logged since it started."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self.log_offset)
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) + "\n"
