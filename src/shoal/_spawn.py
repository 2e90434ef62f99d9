"""Start child processes that die with this one; imports nothing of shoal.

Every long-running child shoal starts (the embedded broker, ``shoal up``'s and the scaler's
workers and combiners, a benchmark's PostgreSQL) goes through ``spawn_tied``. Killed with
SIGKILL (a test's subprocess timeout, the OOM killer), a parent runs no cleanup, and a child
in its own session (``start_new_session``, so that a terminal's Ctrl-C is the parent's to
forward) would run on for ever. On Linux the child asks the kernel for a signal when its
parent dies (``prctl(PR_SET_PDEATHSIG)``): a shoal component then stops as it does on
SIGTERM, Mosquitto saves its state and exits. Elsewhere (macOS, BSD) there is no such call:
the child is a plain ``Popen`` and outlives a killed parent.

The kernel ties the signal to the *thread* that forked, not to the process: a child started
from a thread that later ends (an ``asyncio.to_thread`` worker at interpreter exit) would be
signalled then. Children are therefore forked from the main thread or, when asked from
another thread, from one daemon thread that lives as long as the process.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Final

_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    fn: Callable[..., int] = prctl
    return fn


# Resolved once, before any fork: the child only calls it (no loading, no lookup).
_PRCTL: Final = _load_prctl()

DIES_WITH_PARENT: Final = _PRCTL is not None
"""Whether ``spawn_tied`` children are signalled when this process dies (Linux)."""


def _die_with(parent_pid: int, sig: int) -> Callable[[], None]:
    """The ``preexec_fn``: runs in the child between fork and exec (two system calls)."""

    def preexec() -> None:
        if _PRCTL is None:
            return
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the prctl: nobody will tell us
            os.kill(os.getpid(), sig)

    return preexec


class _Spawner:
    """One daemon thread that forks on behalf of threads that may end before the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, job: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="shoal-spawner", daemon=True
                )
                self._thread.start()
        done: Future[Any] = Future()
        self._jobs.put((job, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                done.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                done.set_exception(exc)


_SPAWNER: Final = _Spawner()


def spawn_tied(
    argv: Sequence[str], *, death_signal: int = signal.SIGTERM, **popen: Any
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **popen)`` whose child gets ``death_signal`` when we die.

    ``death_signal``: what the child receives when this process dies (SIGTERM: a shoal
    component stops within its bounded grace, Mosquitto saves and exits; PostgreSQL wants
    SIGINT for its fast shutdown). On systems without ``PR_SET_PDEATHSIG`` it is ignored
    (``DIES_WITH_PARENT`` is False).

    Raises:
        OSError: the program could not be started (as ``Popen`` raises it).
    """
    if "preexec_fn" in popen:
        raise TypeError("spawn_tied sets preexec_fn itself")
    args = list(argv)

    def start() -> subprocess.Popen[Any]:
        return subprocess.Popen(args, preexec_fn=_die_with(os.getpid(), death_signal), **popen)  # noqa: PLW1509

    if threading.current_thread() is threading.main_thread():
        return start()
    result: subprocess.Popen[Any] = _SPAWNER.run(start)
    return result
