"""Run an asyncio component until it finishes or the process is told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from typing import Any


def run_until_signalled(main: Coroutine[Any, Any, None], stop: Callable[[], None]) -> None:
    """Run ``main``; SIGINT/SIGTERM call ``stop`` (graceful), a second signal cancels."""

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(main)
        signalled = False

        def on_signal() -> None:
            nonlocal signalled
            if signalled:
                task.cancel()
            signalled = True
            stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(runner())
