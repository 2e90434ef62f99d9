"""Sessions on a real Mosquitto where a backlog is waiting: replies behind it, batches, bounds.

A persistent session that comes back finds its queued messages sent ahead of anything it
asks for, so its SUBACK arrives after them; ``BatchedSession`` (the adapter's) hands over
what each read brought and stops reading when too much waits.
"""

from __future__ import annotations

import asyncio
from typing import Self

import pytest

from shoal.broker import AsyncSession, BatchedSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message, Session, SessionFactory
from shoal.loadtest.devices import DevicePublisher
from shoal.schemas.topics import Topics
from tests.support.live import until

BACKLOG = 3_000
REPLY_S = 0.001
"""``AsyncSession``'s reply timeout once connected (aiomqtt's, 10 s by default): a machine on
which reading the backlog ahead of a SUBACK takes longer than that, which reading 3,000
messages always does at 1 ms. ``BatchedSession`` has no fixed reply timeout to shorten."""


class _ImpatientAsync(AsyncSession):
    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self._client.timeout = REPLY_S
        return self


def _persistent(
    factory: SessionFactory, broker: EmbeddedBroker, client_id: str, bound: int | None = None
) -> Session:
    return factory(
        broker.settings,
        client_id,
        clean_start=False,
        session_expiry_s=600,
        manual_ack=True,
        receive_maximum=BACKLOG,
        max_buffered_bytes=bound,
    )


BOUND = 300_000
"""Payload bytes ``BatchedSession`` lets wait: 300 of the backlog's 3,000 1 kB payloads."""
READ = 256 * 1024
"""What one read of the socket may bring past the bound (asyncio reads up to 256 KiB)."""


def _payload(i: int, pad: int) -> bytes:
    return str(i).encode().ljust(pad)


async def _backlog(
    broker: EmbeddedBroker, topic_filter: str, client_id: str, root: str, pad: int = 0
) -> None:
    """A persistent session subscribed to ``topic_filter``, away while ``BACKLOG`` arrive."""
    async with _persistent(AsyncSession, broker, client_id) as session:
        await session.subscribe([topic_filter])
    messages = [(f"{root}/dev/{i % 7}", _payload(i, pad)) for i in range(BACKLOG)]
    await asyncio.to_thread(DevicePublisher(broker.settings).run, iter(messages))


@pytest.mark.parametrize("factory", [_ImpatientAsync, BatchedSession])
def test_a_subscribe_behind_a_backlog_waits_while_messages_arrive(
    broker: EmbeddedBroker, topics: Topics, factory: SessionFactory
) -> None:
    topic_filter = topics.shared("g", topics.under_root("dev/+"))

    async def scenario() -> list[bytes]:
        await _backlog(broker, topic_filter, "back", topics.root)
        got: list[bytes] = []
        async with _persistent(factory, broker, "back") as session:
            # Not consuming yet: the SUBACK comes after the messages sent ahead of it.
            await session.subscribe([topic_filter])
            async for message in session.messages():
                session.ack(message)
                got.append(message.payload)
                if len(got) == BACKLOG:
                    break
        return got

    got = asyncio.run(scenario())
    assert got == [str(i).encode() for i in range(BACKLOG)]


def test_batches_are_what_a_read_brought_and_reading_pauses_past_the_bound(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    topic_filter = topics.under_root("dev/+")

    async def scenario() -> tuple[list[list[Message]], int, int]:
        await _backlog(broker, topic_filter, "batches", topics.root, pad=1000)
        session = _persistent(BatchedSession, broker, "batches", BOUND)
        assert isinstance(session, BatchedSession)
        async with session:
            # not consuming: reading stops past the bound
            await until(lambda: session.pauses > 0, 30, "reading paused")
            await asyncio.sleep(0.2)  # and stays stopped
            waiting = session._waiting_bytes
            assert session.pauses == 1
            # Our own publish's PUBACK is read even so (a consumer may wait for it).
            await asyncio.wait_for(session.publish(topics.under_root("other"), b"x"), 10)
            batches: list[list[Message]] = []
            async for batch in session.message_batches(asyncio.Event()):
                session.ack_many(batch)
                batches.append(batch)
                if sum(map(len, batches)) == BACKLOG:
                    break
            return batches, waiting, session.pauses

    batches, waiting, pauses = asyncio.run(scenario())
    payloads = [m.payload for b in batches for m in b]
    assert payloads == [_payload(i, 1000) for i in range(BACKLOG)]
    assert BOUND <= waiting <= BOUND + READ  # one read past the bound at most
    assert max(map(len, batches)) > 1  # a read brings many
    assert pauses >= 1


def test_qos0_publishes_of_one_turn_go_out_together_and_in_order(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    """A combiner's per-key results: thousands of QoS 0 publishes in a turn, a few writes.

    Gathered packets go out at the end of the turn (or once ``CORK_BYTES`` are gathered, or
    before anything else is written), so the broker gets them all, in order, and a QoS 1
    publish started after them in the same turn arrives after them.
    """
    count, size = 2_000, 300  # 600 kB: at least three writes of CORK_BYTES
    subscribe = BatchedSession(broker.settings, "keys-reader")

    async def scenario() -> tuple[list[Message], int, list[Message]]:
        async with subscribe, BatchedSession(broker.settings, "keys-writer") as writer:
            await subscribe.subscribe([topics.under_root("keys/#")], qos=1)
            before = writer.writes
            for i in range(count):
                writer.publish_started(topics.under_root(f"keys/{i}"), _payload(i, size), qos=0)
            fence = writer.publish_started(topics.under_root("keys/fence"), b"fence")
            await asyncio.wait_for(writer.wait_published([fence]), 10)
            writes = writer.writes - before
            got: list[Message] = []
            async for batch in subscribe.message_batches(asyncio.Event()):
                got += batch
                if len(got) == count + 1:
                    break
            # A turn with QoS 0 publishes only: written at its end, nothing else needed.
            for i in range(3):
                writer.publish_started(topics.under_root(f"keys/late{i}"), b"late", qos=0)
            more: list[Message] = []
            async with asyncio.timeout(10):
                async for batch in subscribe.message_batches(asyncio.Event()):
                    more += batch
                    if len(more) == 3:
                        break
            return got, writes, more

    got, writes, more = asyncio.run(scenario())
    assert [m.payload for m in got[:count]] == [_payload(i, size) for i in range(count)]
    assert got[-1].payload == b"fence"
    assert 3 <= writes <= 5  # 2,000 packets and the fence in a handful of writes
    assert [m.topic for m in more] == [topics.under_root(f"keys/late{i}") for i in range(3)]
