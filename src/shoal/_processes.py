"""Child processes of ``shoal up`` and the local scaler backend: start, stop, kill, log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from shoal._spawn import spawn_tied
from shoal._stopping import PARENT_DEATH_SIGNAL
from shoal.broker.settings import BrokerSettings
from shoal.schemas.topics import Topics


def shoal_argv(*args: str) -> list[str]:
    """The command line of a ``shoal`` sub-command run with this interpreter."""
    return [sys.executable, "-m", "shoal.cli", *args]


def connection_args(broker: BrokerSettings, topics: Topics) -> list[str]:
    """``--broker`` and ``--topic-root`` for a child (credentials travel by environment)."""
    return ["--broker", broker.url, "--topic-root", topics.root]


class ChildProcess:
    """One ``shoal`` sub-command in its own process; output goes to ``log_path``.

    Args:
        name: label for logs and the view.
        argv: full command line.
        log_path: file that receives stdout and stderr.
        env: extra environment (credentials, POLARS_MAX_THREADS).
    """

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """PID of the running process."""
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        """Start (again); output is appended to the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with self.log_path.open("ab") as log:
            self.process = spawn_tied(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Ctrl-C in the terminal reaches us, not the children; they stop when we die.
                start_new_session=True,
                death_signal=PARENT_DEATH_SIGNAL,
            )

    def alive(self) -> bool:
        """Whether it is running."""
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send a signal if running."""
        if self.alive() and self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        """Exit code, or None if still running after ``timeout_s``."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        code = self.wait(timeout_s)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.wait(5)
        return code

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        self.signal(signal.SIGKILL)
        self.wait(5)

    def log_tail(self, lines: int = 20) -> str:
        """The end of its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
