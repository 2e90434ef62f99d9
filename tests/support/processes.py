"""Components as real processes, for fault tests: start, kill -9, restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from shoal.broker.settings import BrokerSettings
from shoal.schemas.topics import Topics


class Component:
    """One ``shoal`` sub-command in its own process (stdout/stderr to a log file)."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.starts += 1

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def broker_args(settings: BrokerSettings, topics: Topics) -> list[str]:
    return ["--broker", settings.url, "--topic-root", topics.root]


def worker(
    index: int, spec_path: Path, settings: BrokerSettings, topics: Topics, log_dir: Path
) -> Component:
    return Component(
        f"worker-{index}",
        ["worker", "--pipeline", str(spec_path), *broker_args(settings, topics)],
        log_dir,
    )


def combiner(
    partition: int,
    spec_path: Path,
    settings: BrokerSettings,
    topics: Topics,
    state_dir: Path,
    log_dir: Path,
) -> Component:
    return Component(
        f"combiner-{partition}",
        [
            "combiner",
            "--pipeline",
            str(spec_path),
            "--partition",
            str(partition),
            "--state-dir",
            str(state_dir / f"p{partition}"),
            "--no-key-topics",
            *broker_args(settings, topics),
        ],
        log_dir,
    )
