"""A worker holds at most ``receive_maximum`` batches handled and not acknowledged, on any broker.

Mosquitto 2.0.11 (Debian bookworm's) sends past a client's Receive Maximum once the client
acknowledges: every PUBACK of the oldest delivery lets up to that many more in (upstream
issue 2306, fixed in 2.0.13). A worker acknowledges a batch only once its partials' PUBACKs
are in, so when those are slow (a broker behind, the chaos run's overload) it used to take
batch after batch, handle each and queue its partials: 90 batches and 164 partials held,
RSS 76 -> 136 MB. Here every batch's "partials" are futures the test completes one at a time,
oldest first, and the number handled and not yet acknowledged never passes the bound; every
batch is still handled exactly once. The worker publishes on a second connection, so the
PUBACKs it waits for arrive while its input is not read.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message, Session
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.topics import Topics

pytestmark = pytest.mark.broker

BOUND = 4
BATCHES = 40


class HeldRoutes:
    """Routes whose every delivery waits for the test to complete its one future."""

    def __init__(self, filters: list[str]) -> None:
        self.filters = filters
        self.joined = asyncio.Event()
        self.handled: list[tuple[bytes, asyncio.Future[None]]] = []
        self._more = asyncio.Condition()

    async def join(self, session: Session) -> None:
        await session.subscribe(self.filters, qos=1)
        self.joined.set()

    async def leave(self, session: Session) -> None:
        await session.unsubscribe(self.filters)

    async def route(
        self,
        session: Session,
        message: Message,
        out: Session,
    ) -> list[asyncio.Future[None]]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.handled.append((message.payload, done))
        async with self._more:
            self._more.notify_all()
        return [done]

    async def handled_more_than(self, count: int) -> None:
        async with asyncio.timeout(10), self._more:
            await self._more.wait_for(lambda: len(self.handled) > count)

    def marker_back(self, token: str) -> bool:
        return False

    def describe(self) -> dict[str, object]:
        return {"pipeline": "held"}


def test_a_worker_holds_no_more_than_its_receive_maximum_while_it_acknowledges(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    inbound = topics.under_root("held/in")

    async def scenario() -> list[int]:
        worker = Worker(
            WorkerConfig(spec=None, broker=broker.settings, topics=topics, receive_maximum=BOUND)
        )
        routes = worker.routes = HeldRoutes([Topics.shared("held", inbound)])
        running = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(routes.joined.wait(), 10)
            async with AsyncSession(broker.settings, "gateway") as gateway:
                for n in range(BATCHES):
                    await gateway.publish(inbound, n.to_bytes(2, "big"))
            held = []
            for acknowledged in range(BATCHES):
                await routes.handled_more_than(acknowledged)
                # What the broker sends past the bound would be taken meanwhile.
                await asyncio.sleep(0.05)
                held.append(len(routes.handled) - acknowledged)
                routes.handled[acknowledged][1].set_result(None)
            await asyncio.sleep(0.2)  # nothing is handled twice
            assert [int.from_bytes(p, "big") for p, _ in routes.handled] == list(range(BATCHES))
            return held
        finally:
            worker.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running, 10)

    held = asyncio.run(scenario())
    assert max(held) <= BOUND, held
    assert max(held) == BOUND  # the bound was reached: the broker had more to send
