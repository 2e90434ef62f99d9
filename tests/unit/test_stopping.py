"""How a process stops on SIGTERM/SIGINT (``shoal._stopping``), in real processes.

Each case runs a small program under ``run_until_signalled`` whose graceful stop cannot
finish (what a component does whose broker is gone), signals it, and times the exit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shoal._stopping import EXIT_FORCED, HARD_EXIT_S

GRACE_S = 0.5

PROGRAM = textwrap.dedent(
    """
    import asyncio, logging, sys, time
    from shoal._stopping import run_until_signalled

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    how = sys.argv[1]
    stopped = asyncio.Event()

    async def main() -> str:
        print("ready", flush=True)
        if how == "blocks":
            time.sleep(60)  # a synchronous call that never returns: only the watchdog helps
        if how == "returns":
            await stopped.wait()
            return "done"
        await asyncio.Event().wait()  # a stop that never completes (a PUBACK that never comes)
        return "never"

    result = run_until_signalled(main(), stopped.set, "test", grace_s=GRACE)
    print("result", result, flush=True)
    """
).replace("GRACE", str(GRACE_S))


def _start(how: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def _finish(process: subprocess.Popen[str], timeout_s: float) -> tuple[int, float, str]:
    started = time.monotonic()
    try:
        out, _ = process.communicate(timeout=timeout_s)
    finally:
        process.kill()
        process.wait(5)
    return process.returncode, time.monotonic() - started, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_that_completes_returns_its_result_with_code_0(sig: signal.Signals) -> None:
    process = _start("returns")
    process.send_signal(sig)
    code, took, out = _finish(process, 10)
    assert code == 0, out
    assert "result done" in out
    assert "WARNING" not in out  # nothing given up, no grace waited for
    assert took < 5, out


def test_a_stop_that_hangs_is_given_up_after_the_grace_with_a_warning_and_code_0() -> None:
    process = _start("hangs")
    process.send_signal(signal.SIGTERM)
    code, took, out = _finish(process, 10)
    assert code == 0, out
    assert "result None" in out  # cancelled after the grace (the watchdog exits with 1)
    assert took >= GRACE_S, out
    assert "WARNING test: not stopped 0.5 s after the signal" in out, out
    assert "giving up what is pending" in out, out


def test_a_second_signal_exits_at_once() -> None:
    process = _start("hangs")
    process.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    code, took, out = _finish(process, 10)
    assert code == 128 + signal.SIGINT, out  # not the grace's 0
    assert took < 5, out
    assert "second SIGINT: exiting at once" in out


def test_a_blocked_event_loop_is_ended_by_the_watchdog() -> None:
    process = _start("blocks")
    process.send_signal(signal.SIGTERM)
    code, took, out = _finish(process, 20)
    assert code == EXIT_FORCED, out
    assert GRACE_S + HARD_EXIT_S - 0.5 <= took < GRACE_S + HARD_EXIT_S + 3, out
    assert "still running" in out


def test_a_second_signal_ends_a_blocked_event_loop_too() -> None:
    process = _start("blocks")
    time.sleep(0.4)  # inside time.sleep now
    process.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    code, took, out = _finish(process, 10)
    assert code == 128 + signal.SIGTERM, out  # not the watchdog's EXIT_FORCED
    assert took < 5, out


def test_repeated_sighups_of_a_dying_parent_are_one_stop_request() -> None:
    # The kernel sends the parent-death signal once per exiting thread of the parent.
    process = _start("hangs")
    for _ in range(3):
        process.send_signal(signal.SIGHUP)
        time.sleep(0.05)
    code, took, out = _finish(process, 10)
    assert code == 0, out
    assert "result None" in out  # given up after the grace, not ended at once
    assert took >= GRACE_S - 0.2, out
    assert "SIGHUP: stopping" in out
    assert "exiting at once" not in out
