"""The read gate (``max_buffered_messages``) never holds back an answer awaited in line.

While the gate is closed the socket is not read, and answers to our own requests come on
the same socket. So it is read regardless while ``publish``, ``subscribe`` or
``unsubscribe`` awaits its answer, even when nobody takes the waiting messages (a pool
combiner subscribes before its message loop runs; a resumed session's queue arrives before
the SUBACK), and nothing is lost or reordered by reading past the bound meanwhile. Real
Mosquitto: it is the broker that sends past the receive maximum.
"""

from __future__ import annotations

import asyncio

import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.settings import BrokerSettings
from shoal.schemas.topics import Topics
from tests.support.live import until

pytestmark = pytest.mark.broker

LIMIT = 4
QUEUED = 60


async def _take_all(session: AsyncSession) -> list[int]:
    seen: list[int] = []
    async with asyncio.timeout(10):
        async for message in session.messages():
            seen.append(int.from_bytes(message.payload, "big"))
            session.ack(message)
            if len(seen) == QUEUED:
                break
    return seen


def _gated(settings: BrokerSettings, client_id: str, *, persistent: bool = False) -> AsyncSession:
    return AsyncSession(
        settings,
        client_id,
        clean_start=not persistent,
        session_expiry_s=60 if persistent else 0,
        manual_ack=True,
        receive_maximum=LIMIT,
        max_buffered_messages=LIMIT,
    )


def test_publish_and_unsubscribe_get_their_answers_while_the_gate_is_closed(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    topic = topics.under_root("gated")

    async def scenario() -> list[int]:
        async with (
            AsyncSession(broker.settings, "gate-pub") as pub,
            _gated(broker.settings, "gate-w") as w,
        ):
            await w.subscribe([topic])
            for i in range(QUEUED):
                await pub.publish(topic, i.to_bytes(2, "big"))
            # nobody takes messages: the gate closes at LIMIT
            await until(lambda: w._gate.paused_fd is not None, 10, "the gate closed")
            async with asyncio.timeout(5):
                await w.publish(topics.under_root("other"), b"x")  # its PUBACK is read
                await w.unsubscribe([topics.under_root("nothing")])  # its UNSUBACK too
            return await _take_all(w)

    assert asyncio.run(scenario()) == list(range(QUEUED))  # all, once, in order


def test_a_resumed_session_subscribes_again_behind_its_queue_with_nobody_taking(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    """The queue arrives before the SUBACK; without reading past the bound it never would."""
    topic = topics.under_root("resumed")

    async def scenario() -> list[int]:
        async with _gated(broker.settings, "gate-r", persistent=True) as w:
            await w.subscribe([topic])
        async with AsyncSession(broker.settings, "gate-pub2") as pub:
            for i in range(QUEUED):
                await pub.publish(topic, i.to_bytes(2, "big"))
        async with _gated(broker.settings, "gate-r", persistent=True) as w:
            async with asyncio.timeout(8):
                await w.subscribe([topic])  # again (idempotent), as a combiner does
            return await _take_all(w)

    assert asyncio.run(scenario()) == list(range(QUEUED))
