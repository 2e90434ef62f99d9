"""A slow consumer's received messages stay within ``max_buffered_bytes`` (real Mosquitto).

Mosquitto 2.0.11 hands a subscriber its whole queue however slowly it acknowledges, so the
bound is the session's own: past it, it stops reading the socket until the consumer has
taken half. Nothing is lost on the way, and a publisher on another connection keeps getting
its PUBACKs meanwhile (the combiner's outputs session).
"""

from __future__ import annotations

import asyncio

import pytest

from shoal.broker import AsyncSession, BatchedSession, default_intake_session_factory
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Session, SessionFactory

pytestmark = pytest.mark.broker

MESSAGE_BYTES = 100_000
MESSAGES = 120
LIMIT = 1_000_000


async def _consume(broker: EmbeddedBroker, limit: int | None) -> tuple[int, int, int, float]:
    """(messages taken, most bytes waiting at once, pauses, slowest side PUBACK in s)."""
    settings = broker.settings
    most = taken = 0
    slowest = 0.0
    async with AsyncSession(
        settings, "intake", clean_start=False, session_expiry_s=60, max_buffered_bytes=limit
    ) as intake:
        await intake.subscribe(["bulk"], qos=1)
        async with (
            AsyncSession(settings, "bulk-publisher") as publisher,
            AsyncSession(settings, "side-publisher") as side,
        ):
            published = [
                publisher.publish_started("bulk", bytes([i % 251]) * MESSAGE_BYTES)
                for i in range(MESSAGES)
            ]
            async for message in intake.messages():
                assert message.payload == bytes([taken % 251]) * MESSAGE_BYTES  # in order, whole
                taken += 1
                most = max(most, intake._gate.buffered)
                started = asyncio.get_running_loop().time()
                await side.publish("side", b"x")  # another connection: its PUBACK comes at once
                slowest = max(slowest, asyncio.get_running_loop().time() - started)
                await asyncio.sleep(0.01)  # a consumer slower than its input
                if taken == MESSAGES:
                    break
            await publisher.wait_published(published)
    return taken, most, intake._gate.pauses, slowest


def test_a_slow_consumer_holds_at_most_its_bound_and_loses_nothing(broker: EmbeddedBroker) -> None:
    taken, most, pauses, slowest = asyncio.run(_consume(broker, LIMIT))
    assert taken == MESSAGES
    assert pauses > 0
    # One read may bring a few messages past the bound before the reader is removed.
    assert most <= LIMIT + 4 * MESSAGE_BYTES
    assert slowest < 2.0


def test_without_a_bound_the_queue_holds_the_broker_backlog(broker: EmbeddedBroker) -> None:
    taken, most, pauses, _ = asyncio.run(_consume(broker, None))
    assert taken == MESSAGES
    assert pauses == 0
    assert most > 4 * LIMIT  # what the bound prevents: the backlog in the consumer's memory


def _waiting_bytes(session: Session) -> int:
    """Received payload bytes not taken yet (each implementation counts them its own way)."""
    if isinstance(session, AsyncSession):
        return session._gate.buffered
    assert isinstance(session, BatchedSession)
    return session._waiting_bytes


async def _resume(broker: EmbeddedBroker, factory: SessionFactory) -> tuple[int, int]:
    """(messages taken, most bytes waiting) of a session resumed onto a backlog.

    What a combiner partition does after a restart: its persistent session returns to the
    partials queued meanwhile and subscribes again beside its message loop; the SUBACK comes
    after the backlog, so the loop must take messages for it to arrive.
    """
    settings = broker.settings
    async with factory(settings, "resumed", clean_start=False, session_expiry_s=60) as first:
        await first.subscribe(["bulk"], qos=1)
    async with AsyncSession(settings, "bulk-publisher") as publisher:
        await publisher.wait_published(
            [
                publisher.publish_started("bulk", bytes([i % 251]) * MESSAGE_BYTES)
                for i in range(MESSAGES)
            ]
        )
    most = taken = 0
    async with factory(
        settings, "resumed", clean_start=False, session_expiry_s=60, max_buffered_bytes=LIMIT
    ) as intake:
        subscribed = asyncio.ensure_future(intake.subscribe(["bulk"], qos=1))
        async for message in intake.messages():
            assert message.payload == bytes([taken % 251]) * MESSAGE_BYTES  # in order, whole
            taken += 1
            most = max(most, _waiting_bytes(intake))
            await asyncio.sleep(0.01)  # a consumer slower than its input
            if taken == MESSAGES:
                break
        await asyncio.wait_for(subscribed, 30)
    return taken, most


@pytest.mark.parametrize(
    "factory",
    [default_intake_session_factory(), AsyncSession],
    ids=["combiner-intake", "async-session"],
)
def test_a_resumed_session_holds_its_bound_while_it_subscribes_beside_its_loop(
    broker: EmbeddedBroker, factory: SessionFactory
) -> None:
    # The combiner's intake (``CombinerRuntime``'s default), and an ``AsyncSession``, whose
    # gate reads past the bound for an awaited request only once nobody takes messages
    # (``STALL_S``): here the loop keeps taking them, so the bound holds (before, it read
    # the whole backlog in front of the SUBACK: more than 4 MB).
    taken, most = asyncio.run(_resume(broker, factory))
    assert taken == MESSAGES
    assert most <= LIMIT + 4 * MESSAGE_BYTES
