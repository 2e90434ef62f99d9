"""The in-memory broker where it goes beyond the shared session contract
(``tests/integration/test_session_contract.py`` runs that on both brokers)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.broker.memory import MemoryBroker
from shoal.broker.session import Will
from shoal.errors import BrokerError, PayloadTooLargeError
from shoal.schemas.topics import topic_matches


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("+/+", "a/b", True),
        ("#", "a/b", True),
        ("#", "$SYS/broker/uptime", False),
        ("+/broker/uptime", "$SYS/broker/uptime", False),
        ("$SYS/#", "$SYS/broker/uptime", True),
        ("a/b", "a/c", False),
    ],
)
def test_topic_filters_match_as_mqtt_says(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


def test_a_dropped_client_loses_its_iteration_and_its_will_goes_out() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        async with (
            memory.session(memory.settings, "watcher") as watcher,
            memory.session(memory.settings, "w", will=Will("gone/w", b"bye")) as worker,
        ):
            await watcher.subscribe(["gone/+"])
            async with memory.session(memory.settings, "polite", will=Will("gone/p", b"x")):
                pass  # a clean DISCONNECT: no will
            memory.drop("w")
            with pytest.raises(BrokerError, match="lost"):
                await anext(aiter(worker.messages()))
            message = await anext(aiter(watcher.messages()))
            assert (message.topic, message.payload) == ("gone/w", b"bye")
        assert memory.connected() == []

    asyncio.run(scenario())


def test_a_second_client_with_the_same_id_takes_the_session_over() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        async with memory.session(memory.settings, "c") as first:
            async with memory.session(memory.settings, "c"):
                with pytest.raises(BrokerError):
                    await first.subscribe(["t"])
                assert memory.connected() == ["c"]

    asyncio.run(scenario())


def test_an_offline_persistent_client_gets_qos1_but_not_qos0_nor_shared_messages() -> None:
    memory = MemoryBroker()
    persistent = {"clean_start": False, "session_expiry_s": 60}

    async def scenario() -> None:
        async with memory.session(memory.settings, "c", **persistent) as client:
            await client.subscribe(["t", "$share/g/s"])
        async with memory.session(memory.settings, "pub") as pub:
            await pub.publish("t", b"kept", qos=1)
            await pub.publish("t", b"dropped", qos=0)
            await pub.publish("s", b"nobody in the group")
        async with memory.session(memory.settings, "c", **persistent) as client:
            got = []
            async for message in client.messages():
                got.append(message.payload)
                if len(got) == 1:
                    await client.publish("t", b"end")  # still subscribed to t
                if message.payload == b"end":
                    break
        assert got == [b"kept", b"end"]

    asyncio.run(scenario())


def test_sizes_and_closed_sessions_are_refused() -> None:
    memory = MemoryBroker(max_packet_size=1024)

    async def scenario() -> None:
        session = memory.session(memory.settings, "c")
        with pytest.raises(BrokerError, match="not open"):
            await session.subscribe(["t"])
        async with session:
            assert session.max_packet_size == 1024
            with pytest.raises(PayloadTooLargeError):
                session.publish_started("t", b"x" * 1024)

    asyncio.run(scenario())
