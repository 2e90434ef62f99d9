"""Background tasks tied to one MQTT session: they live and die with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def supervised(
    stop: asyncio.Event, *coroutines: Coroutine[Any, Any, None]
) -> AsyncIterator[asyncio.Event]:
    """Run ``coroutines`` in the background while the body runs.

    Yields an event that is set when ``stop`` is set or any background task fails; use it to
    end the body's message loop. On exit the tasks are cancelled and the first failure, if
    any, is raised (e.g. the ``BrokerError`` of a lost connection).
    """
    ending = asyncio.Event()
    failures: list[BaseException] = []

    def watch(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            failures.append(exc)
            ending.set()

    async def relay() -> None:
        await stop.wait()
        ending.set()

    tasks = [asyncio.create_task(c) for c in (*coroutines, relay())]
    for task in tasks:
        task.add_done_callback(watch)
    try:
        yield ending
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failures:
        raise failures[0]


async def pause(delay_s: float, wake: asyncio.Event) -> None:
    """Sleep ``delay_s``, or less if ``wake`` is set (a reconnect delay that a stop cuts short).

    ``asyncio.timeout``, never ``wait_for``: Python 3.11's ``wait_for`` can drop a
    cancellation that lands as the event is set (CPython gh-86296).
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay_s):
            await wake.wait()
