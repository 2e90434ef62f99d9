"""One outputs connection for many partitions, on a real Mosquitto (``shoal.broker.pooled``).

What a per-partition connection got from the broker's takeover, a lease must give by itself:
once it ended, nothing more of its user's is published, and its end waits until what was
started is acknowledged; one lease's failures are its own; the connection's Will clears the
member's announcement when it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from shoal.broker import BatchedSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.pooled import PooledOutputs
from shoal.broker.session import Message, Session, Will, unique_client_id
from shoal.errors import BrokerError, PayloadTooLargeError
from shoal.schemas.topics import Topics
from tests.support.live import until

pytestmark = pytest.mark.broker


@contextlib.asynccontextmanager
async def _pool(broker: EmbeddedBroker, will: Will | None = None) -> AsyncIterator[PooledOutputs]:
    pool = PooledOutputs(BatchedSession, broker.settings, unique_client_id("pooled"), will=will)
    task = asyncio.create_task(pool.run())
    try:
        await pool.session()
        yield pool
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _collect(session: Session, into: list[Message], stop: asyncio.Event) -> None:
    async for message in session.messages_until(stop):
        into.append(message)


async def _leases(broker: EmbeddedBroker, topics: Topics) -> None:
    seen: list[Message] = []
    stop = asyncio.Event()
    async with BatchedSession(broker.settings, unique_client_id("sub")) as sub:
        await sub.subscribe([topics.under_root("out/#")], qos=1)
        reading = asyncio.create_task(_collect(sub, seen, stop))
        async with _pool(broker) as pool:
            a, b = pool.lease(), pool.lease()
            async with b:
                async with a:
                    started = a.publish_started(topics.under_root("out/a"), b"a1")
                    assert a.max_packet_size is not None  # the broker profiles set one
                    too_large = b"x" * a.max_packet_size
                    with pytest.raises(PayloadTooLargeError):
                        a.publish_started(topics.under_root("out/a"), too_large)
                # its end waited for its PUBACK
                assert started.done()
                assert started.exception() is None
                late = a.publish_started(topics.under_root("out/a"), b"after its end")
                with pytest.raises(BrokerError):
                    await late
                # the other lease, on the same connection, was not touched by any of it
                await b.publish(topics.under_root("out/b"), b"b1")
            assert pool.connections == 1
        await until(lambda: [m.payload for m in seen] == [b"a1", b"b1"], what="both leases")
        await asyncio.sleep(0.2)
        stop.set()
        await reading
    assert [m.payload for m in seen] == [b"a1", b"b1"]  # nothing after the end


def test_an_ended_lease_publishes_nothing_more_and_the_others_go_on(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    asyncio.run(asyncio.wait_for(_leases(broker, topics), 30))


async def _will(broker: EmbeddedBroker, topics: Topics) -> None:
    presence = topics.pool_combiner("m1")
    seen: list[Message] = []
    stop = asyncio.Event()
    async with BatchedSession(broker.settings, unique_client_id("sub")) as sub:
        await sub.subscribe([presence], qos=1)
        reading = asyncio.create_task(_collect(sub, seen, stop))
        async with _pool(broker, Will(presence, b"", qos=1, retain=True)) as pool:
            async with pool.lease() as lease:
                await lease.publish(presence, b"announced", retain=True)
            pool.reset("a test")  # as a killed process: no DISCONNECT, the Will goes out
            await until(lambda: [m.payload for m in seen] == [b"announced", b""], what="the Will")
            await until(lambda: pool.connections == 2, what="a new connection")
        stop.set()
        await reading


def test_the_connection_will_clears_the_announcement_and_it_reconnects(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    asyncio.run(asyncio.wait_for(_will(broker, topics), 30))


async def _sync(broker: EmbeddedBroker, topics: Topics) -> None:
    session = BatchedSession(broker.settings, unique_client_id("sync"))
    async with session:
        for i in range(100):
            session.publish_started(topics.under_root("sync"), b"%d" % i, qos=0, retain=True)
        await session.sync()
        async with BatchedSession(broker.settings, unique_client_id("read")) as reader:
            await reader.subscribe([topics.under_root("sync")], qos=1)
            async with asyncio.timeout(5):
                async for message in reader.messages():
                    assert message.payload == b"99"
                    break
        session.abort("a test")
        with pytest.raises(BrokerError):
            await session.sync()


def test_sync_answers_after_earlier_publishes_and_fails_on_a_dropped_connection(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    asyncio.run(asyncio.wait_for(_sync(broker, topics), 30))
