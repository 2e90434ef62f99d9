"""A control plane and pool workers running beside a test, on a real broker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock
from shoal.control.service import ControlPlane
from shoal.schemas.topics import Topics


@contextlib.asynccontextmanager
async def running_plane(
    settings: BrokerSettings, topics: Topics, clock: Clock
) -> AsyncIterator[ControlPlane]:
    """A ``ControlPlane`` that has restored its registry; stopped (and awaited) on exit."""
    plane = ControlPlane(settings, topics, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(plane.run(stop))
    try:
        await asyncio.wait_for(plane.ready.wait(), 10)
        yield plane
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


class Component(Protocol):
    """A worker, pool worker or pool combiner: runs until stopped."""

    async def run(self) -> None: ...

    def stop(self) -> None: ...


@contextlib.asynccontextmanager
async def pool_running(*workers: Component) -> AsyncIterator[list[asyncio.Task[None]]]:
    """Run workers (pool or pinned) or pool combiners as tasks; stopped (and awaited) on exit."""
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        yield tasks
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
