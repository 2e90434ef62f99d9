"""A control plane and pool workers running beside a test, on a real broker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock
from shoal.control.service import ControlPlane
from shoal.runtime.hosting import CombinerHost, HostConfig
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.topics import Topics
from tests.support.datasets import GeneratedBatch


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


def pool_members(
    settings: BrokerSettings, topics: Topics, state: Path, workers: int = 2
) -> tuple[list[Worker], CombinerHost]:
    """Pool workers (heartbeats every 200 ms) and one pool combiner (``c0``, ticks of 50 ms)."""
    pool = [
        Worker(WorkerConfig(None, settings, topics, worker_id=f"pool{i}", heartbeat_ms=200))
        for i in range(workers)
    ]
    config = HostConfig(settings, topics, state, "c0", tick_ms=50, per_key_results=False)
    return pool, CombinerHost(config)


def unconfirmed(
    batches: list[GeneratedBatch], host: CombinerHost, partitions: int
) -> list[int] | None:
    """Indexes of batches some partition the host serves has not confirmed (every open
    version applied); None while fewer than ``partitions`` are served."""
    runtimes = [t.runtime for t in host.terms.values() if t.runtime.serving]
    if len(runtimes) < partitions:
        return None
    done = [r.chain.confirmable() for r in runtimes]
    return [i for i, b in enumerate(batches) if any(d.get(b.gateway_id, -1) < b.seq for d in done)]
