"""Mosquitto fences a client id: what the combiner pool's ownership stands on.

A second CONNECT with a client id that is connected takes the session over: the first
connection is closed by the broker (MQTT 5 DISCONNECT 0x8E "session taken over"), its
next receive raises ``BrokerError``, its publishes fail, and QoS 1 messages queued for the
session while nobody was connected are delivered to the new owner. For both session kinds a
partition's intake may be (a pool member's is a ``BatchedSession``).
"""

from __future__ import annotations

import asyncio

import pytest

from shoal.broker import AsyncSession, BatchedSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import SessionFactory, unique_client_id
from shoal.errors import BrokerError
from shoal.schemas.topics import Topics

pytestmark = pytest.mark.broker


async def _scenario(broker: EmbeddedBroker, topics: Topics, intake: SessionFactory) -> None:
    settings = broker.settings
    client_id = unique_client_id("takeover")
    topic = topics.partials("p", 0)
    # A session that subscribes, then vanishes: messages queue for it in the broker.
    async with intake(settings, client_id, clean_start=False, session_expiry_s=60) as s:
        await s.subscribe([topic], qos=1)
    async with AsyncSession(settings, unique_client_id("pub")) as pub:
        for i in range(3):
            await pub.publish(topic, b"queued-%d" % i, qos=1)
    first = intake(settings, client_id, clean_start=False, session_expiry_s=60)
    async with first:
        got = []
        async for message in first.messages():
            got.append(message.payload)
            if len(got) == 3:
                break
        assert got == [b"queued-0", b"queued-1", b"queued-2"]
        # Queue more while `first` is connected but not reading, then take the session over.
        async with AsyncSession(settings, unique_client_id("pub")) as pub:
            await pub.publish(topic, b"after", qos=1)
        second = intake(settings, client_id, clean_start=False, session_expiry_s=60)
        async with second:
            with pytest.raises(BrokerError):  # noqa: PT012 - the drop ends the iteration
                async with asyncio.timeout(5):
                    async for _ in first.messages():
                        pass  # whatever arrived before the takeover, then the link drops
            with pytest.raises(BrokerError):
                await first.publish(topics.results("p"), b"from the deposed owner", qos=1)
            # The session (its subscription and anything queued since) is the new owner's.
            async with AsyncSession(settings, unique_client_id("pub")) as pub:
                await pub.publish(topic, b"for-second", qos=1)
            seen = []
            async with asyncio.timeout(5):
                async for message in second.messages():
                    seen.append(message.payload)
                    if message.payload == b"for-second":
                        break
            assert seen[-1] == b"for-second"


@pytest.mark.parametrize("intake", [AsyncSession, BatchedSession], ids=["aiomqtt", "batched"])
def test_a_second_connect_with_the_client_id_deposes_the_first(
    broker: EmbeddedBroker, topics: Topics, intake: SessionFactory
) -> None:
    asyncio.run(asyncio.wait_for(_scenario(broker, topics, intake), 30))
