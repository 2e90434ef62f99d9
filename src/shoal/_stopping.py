"""How a long-running process stops on SIGTERM/SIGINT; imports nothing of shoal.

Every long-running command (worker, combiner, adapter, control plane, scaler, sink, archive,
simulate, ``shoal up``) stops the same way, whatever state the broker is in
(docs/guarantees.md, "Stopping"):

1. the first SIGTERM or SIGINT asks the component to stop gracefully: a worker drains, a
   combiner writes its last checkpoint, an adapter seals and acknowledges what it holds;
2. if it has not finished ``grace_s`` later (the broker is gone and a PUBACK never comes, a
   reconnect loop has nothing to reconnect to), what is pending is given up, with a
   WARNING: its task is cancelled and the process exits with code 0. Nothing unacknowledged
   is lost: the broker delivers it again, a gateway's spool sends it again;
3. should the process still be alive ``HARD_EXIT_S`` later (a thread that does not end), it
   exits with ``EXIT_FORCED``;
4. a second SIGTERM or SIGINT exits at once, with 128 + the signal's number (130, 143).

A shoal command started by another gets SIGHUP when its parent dies
(``PARENT_DEATH_SIGNAL``): a first signal like the others, never a second one.

``run_until_signalled`` does all of this for an asyncio component; ``stop_signals`` is the
signal part alone, for commands that bound their own stop (``shoal up``, ``shoal simulate``,
the sinks, the archive). The handlers are plain ``signal.signal`` ones, not the event
loop's: a second signal must end the process even while the loop is blocked in a
synchronous call. Child processes started with ``shoal._spawn.spawn_tied`` get SIGTERM
when the process ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType
from typing import Any, Final, TypeVar

log = logging.getLogger("shoal.stop")

T = TypeVar("T")

STOP_GRACE_S: Final = 8.0
"""How long a graceful stop may take before what is pending is given up (under the 10 s
that Docker, ``ChildProcess.stop`` and most supervisors wait before SIGKILL)."""

HARD_EXIT_S: Final = 2.0
"""After the grace: how long the given-up work may take to unwind before the process exits."""

EXIT_FORCED: Final = 1
"""Exit code when the process had to be ended ``HARD_EXIT_S`` after giving up."""

PARENT_DEATH_SIGNAL: Final = signal.SIGHUP
"""What a shoal command started by another (``shoal._processes.ChildProcess``) receives
when its parent dies: a graceful stop, like SIGTERM, that repeats do not turn into an
immediate exit (see ``stop_signals``)."""

FLUSH_S: Final = 1.0
"""How long an immediate exit waits for its last log lines to be written."""


def exit_now(code: int, warning: str = "") -> None:
    """Log ``warning``, flush what was logged and printed, end the process without cleanup.

    The logging and flushing run in a thread given ``FLUSH_S``: a stuck output (a full pipe
    nobody reads, a lock held by a blocked thread) must not keep the process alive.
    """

    def flush() -> None:
        if warning:
            log.warning("%s", warning)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flusher = threading.Thread(target=flush, name="shoal-exit-flush", daemon=True)
    flusher.start()
    flusher.join(FLUSH_S)
    os._exit(code)


@contextlib.contextmanager
def stop_signals(
    name: str, on_first: Callable[[], object], grace_s: float | None = STOP_GRACE_S
) -> Iterator[Callable[[], bool]]:
    """SIGINT/SIGTERM/SIGHUP: the first calls ``on_first``; a later SIGINT/SIGTERM exits at once.

    SIGHUP is how a shoal child learns that its parent died (``PARENT_DEATH_SIGNAL``): the
    kernel sends it once for every thread of the parent that exits, so a repeated SIGHUP
    only repeats the request.

    ``on_first`` runs in the signal handler: keep it short and thread-safe (hand over to
    the event loop with ``call_soon_threadsafe``). ``grace_s``: the first signal also arms
    a watchdog that ends the process ``grace_s + HARD_EXIT_S`` later (None: no watchdog;
    the caller bounds its own stop).
    Yields a function that says whether a signal arrived. The previous handlers come back
    only if none did: once stopping, a second signal must keep exiting at once through the
    interpreter's own shutdown.
    """
    signalled = False

    def handle(signum: int, _frame: FrameType | None) -> None:
        nonlocal signalled
        sig = signal.Signals(signum).name
        if signalled and signum == PARENT_DEATH_SIGNAL:
            return
        if signalled:
            exit_now(128 + signum, f"{name}: second {sig}: exiting at once")
        signalled = True
        if grace_s is None:
            log.info("%s: %s: stopping (send it again to exit at once)", name, sig)
        else:
            log.info(
                "%s: %s: stopping, within %g s (send it again to exit at once)",
                name,
                sig,
                grace_s,
            )
            _watchdog(name, grace_s + HARD_EXIT_S)
        on_first()

    signals = (signal.SIGINT, signal.SIGTERM, PARENT_DEATH_SIGNAL)
    previous = {sig: signal.signal(sig, handle) for sig in signals}
    try:
        yield lambda: signalled
    finally:
        if not signalled:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _watchdog(name: str, after_s: float) -> None:
    def run() -> None:
        time.sleep(after_s)
        exit_now(EXIT_FORCED, f"{name}: still running {after_s:g} s after the stop signal: exiting")

    threading.Thread(target=run, name="shoal-stop-watchdog", daemon=True).start()


def run_until_signalled(
    main: Coroutine[Any, Any, T],
    stop: Callable[[], None],
    name: str,
    *,
    grace_s: float = STOP_GRACE_S,
) -> T | None:
    """Run ``main`` until it returns; SIGINT/SIGTERM call ``stop`` (see the module docstring).

    Returns what ``main`` returned, or None if it was given up after ``grace_s``.
    """

    async def runner() -> T | None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(main)

        def give_up() -> None:
            if not task.done():
                log.warning(
                    "%s: not stopped %g s after the signal (is the broker gone?): giving up "
                    "what is pending; unacknowledged input is delivered again",
                    name,
                    grace_s,
                )
                task.cancel()

        def begin() -> None:
            stop()
            loop.call_later(grace_s, give_up)

        with stop_signals(name, lambda: loop.call_soon_threadsafe(begin), grace_s):
            settle_heap()
            with contextlib.suppress(asyncio.CancelledError):
                return await task
            return None

    return asyncio.run(runner())


def settle_heap() -> None:
    """Put what start-up made (modules, polars, numpy, the spec) out of the collector's sight.

    A component's heap after start-up is ~57,000 tracked objects that live as long as the
    process. A full collection walks them all (175-475 ms each on the shared 2-core test
    machine), and one that lands in a batch's handling becomes that batch's latency.
    ``gc.freeze`` moves them to the permanent generation, so collections only look at what
    came after (a full one then takes ~0 ms). Cyclic garbage made before is collected first.
    """
    gc.collect()
    gc.freeze()
