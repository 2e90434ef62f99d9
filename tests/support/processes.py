"""Components as real processes, for fault tests (built on ``shoal._processes``)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from pathlib import Path

import psutil

from shoal._processes import ChildProcess, connection_args, shoal_argv
from shoal.broker.settings import BrokerSettings
from shoal.schemas.topics import Topics


def read_until(process: subprocess.Popen[str], pattern: str, timeout_s: float = 20) -> str:
    """The first line of ``process``'s stdout that matches ``pattern`` (AssertionError: none)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


class Component(ChildProcess):
    """A child process that counts its starts (for failure messages)."""

    starts = 0

    def start(self) -> None:
        super().start()
        self.starts += 1

    def kill9(self) -> None:
        self.kill()


def worker(
    index: int, spec_path: Path, settings: BrokerSettings, topics: Topics, log_dir: Path
) -> Component:
    return Component(
        f"worker-{index}",
        shoal_argv("worker", "--pipeline", str(spec_path), *connection_args(settings, topics)),
        log_dir / f"worker-{index}.log",
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
        shoal_argv(
            "combiner",
            "--pipeline",
            str(spec_path),
            "--partition",
            str(partition),
            "--state-dir",
            str(state_dir / f"p{partition}"),
            "--no-key-topics",
            *connection_args(settings, topics),
        ),
        log_dir / f"combiner-{partition}.log",
    )


def run_shoal(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``shoal <args>`` to the end; the output is captured, the exit code not checked.

    On timeout everything it started is killed too (shoal's children run in sessions of their
    own): a broker or a pipeline left running would take CPU from the tests run next or beside
    it."""
    argv = shoal_argv(*args)
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            process.kill()
            process.communicate()
            raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def assert_ran(result: subprocess.CompletedProcess[str]) -> None:
    """Exit code 0, or the end of what the command said."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def pool_combiner(
    member: str, settings: BrokerSettings, topics: Topics, state_dir: Path, log_dir: Path
) -> Component:
    """``shoal combiner`` without ``--pipeline``: a combiner pool member named ``member``."""
    return Component(
        f"pool-combiner-{member}",
        shoal_argv(
            "combiner",
            "--id",
            member,
            "--state-dir",
            str(state_dir),
            "--no-key-topics",
            *connection_args(settings, topics),
        ),
        log_dir / f"pool-combiner-{member}.log",
    )
