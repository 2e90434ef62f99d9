"""``messages_until``: a stop ends the iteration; a cancellation of the consumer is not a stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from shoal.broker._shared import _until_stopped
from shoal.broker.session import Message


async def _slow_to_cancel(winding_down: asyncio.Event) -> AsyncIterator[Message]:
    """Yields nothing; when cancelled it takes a while to wind down (like a real receive)."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        winding_down.set()
        await asyncio.sleep(0.2)
        raise
    yield Message("never", b"")  # pragma: no cover - makes this an async generator


def test_a_stop_ends_the_iteration() -> None:
    async def scenario() -> list[Message]:
        stop = asyncio.Event()
        stop.set()
        return [m async for m in _until_stopped(_slow_to_cancel(asyncio.Event()), stop)]

    assert asyncio.run(scenario()) == []


def test_cancelling_the_consumer_while_the_receive_winds_down_propagates() -> None:
    async def scenario() -> tuple[bool, bool]:
        stop = asyncio.Event()
        winding_down = asyncio.Event()
        ended_normally = False

        async def consume() -> None:
            nonlocal ended_normally
            async for _ in _until_stopped(_slow_to_cancel(winding_down), stop):
                pass
            ended_normally = True

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        stop.set()
        await winding_down.wait()
        task.cancel()  # lands while the pending receive is winding down
        await asyncio.wait({task})
        return task.cancelled(), ended_normally

    cancelled, ended_normally = asyncio.run(scenario())
    assert cancelled
    assert not ended_normally
