"""`shoal broker` and `shoal view` stop on SIGINT even when started with SIGINT ignored.

A shell without job control (a script's `shoal broker &`) starts background commands with
SIGINT ignored; Python then raises no KeyboardInterrupt, so a command that relied on it kept
running. Both install their own handler, as the other components do.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess

import psutil
import pytest

from shoal._processes import shoal_argv
from tests.support.processes import read_until

pytestmark = pytest.mark.broker  # `shoal broker` starts its own Mosquitto


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("argv", "ready"),
    [
        (("broker", "--port", "0", "--ws-port", "-1"), r"listening on mqtt://"),
        (("view", "--port", "0", "--ws-url", "ws://127.0.0.1:9/mqtt"), r"shoal view: http://"),
    ],
    ids=["broker", "view"],
)
def test_stops_on_sigint_inherited_as_ignored(argv: tuple[str, ...], ready: str) -> None:
    process = subprocess.Popen(
        shoal_argv(*argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint,  # noqa: PLW1509 - what a non-interactive shell does
    )
    try:
        read_until(process, ready, timeout_s=30)
        children = psutil.Process(process.pid).children(recursive=True)
        if argv[0] == "broker":
            assert any("mosquitto" in child.name() for child in children), children
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running: {alive}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        with contextlib.suppress(Exception):
            assert process.stdout is not None
            process.stdout.close()
