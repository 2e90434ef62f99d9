"""The embedded broker starts from a profile, persists across restarts, and explains failures."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from shoal.broker import AsyncSession, EmbeddedBroker, unique_client_id
from shoal.errors import BrokerError, BrokerNotFoundError, ConfigError, PayloadTooLargeError


def _roundtrip(broker: EmbeddedBroker, topic: str) -> bytes:
    async def go() -> bytes:
        async with AsyncSession(broker.settings, unique_client_id("rt")) as session:
            await session.subscribe([topic])
            await session.publish(topic, b"ping", content_type="text/plain")
            async for message in session.messages():
                assert message.content_type == "text/plain"
                return message.payload
        raise AssertionError("unreachable")

    return asyncio.run(asyncio.wait_for(go(), 10))


def test_dev_profile_round_trip_and_packet_limit(broker: EmbeddedBroker) -> None:
    assert broker.running
    assert _roundtrip(broker, "probe/a") == b"ping"
    text = broker.config_path.read_text()
    assert "max_queued_messages 0" in text
    assert "max_queued_bytes" in text

    async def too_big() -> None:
        async with AsyncSession(broker.settings, unique_client_id("big")) as session:
            assert session.max_packet_size == 16 * 1024 * 1024
            await session.publish("probe/big", b"x" * (session.max_packet_size + 1))

    with pytest.raises(PayloadTooLargeError, match="was not sent"):
        asyncio.run(too_big())


def test_restart_keeps_port_and_retained_state(broker: EmbeddedBroker) -> None:
    async def retain() -> None:
        async with AsyncSession(broker.settings, unique_client_id("r")) as session:
            await session.publish("probe/retained", b"kept", retain=True)

    asyncio.run(retain())
    port = broker.port
    broker.restart()  # SIGTERM: mosquitto saves its state
    assert broker.port == port
    assert _roundtrip(broker, "probe/after") == b"ping"

    async def read_retained() -> bytes:
        async with AsyncSession(broker.settings, unique_client_id("r2")) as session:
            await session.subscribe(["probe/retained"])
            async for message in session.messages():
                return message.payload
        raise AssertionError("unreachable")

    assert asyncio.run(asyncio.wait_for(read_retained(), 10)) == b"kept"


def test_a_persistent_session_gets_its_queue_back_after_a_restart(broker: EmbeddedBroker) -> None:
    """Messages delivered but never acknowledged, and messages queued while the client was
    away, reach a persistent session that reconnects to the restarted broker (a combiner
    after a broker restart). Mochi 2.7.9 stored them without packet ids and closed every
    such reconnect right after CONNACK (docs/brokers.md, fixed in shoal-mochi)."""
    topic = "probe/partials/0"
    persistent = {"clean_start": False, "session_expiry_s": 300, "manual_ack": True}

    async def first_life() -> None:
        async with AsyncSession(broker.settings, "c-restart", **persistent) as client:
            await client.subscribe([topic])
            async with AsyncSession(broker.settings, unique_client_id("pub")) as pub:
                for i in range(3):
                    await pub.publish(topic, b"delivered-%d" % i)
                got = []
                async for message in client.messages():  # never acknowledged
                    got.append(message.payload)
                    if len(got) == 3:
                        break
        async with AsyncSession(broker.settings, unique_client_id("pub")) as pub:
            for i in range(2):
                await pub.publish(topic, b"queued-%d" % i)

    async def second_life() -> list[bytes]:
        got = []
        async with AsyncSession(broker.settings, "c-restart", **persistent) as client:
            async for message in client.messages():
                got.append(message.payload)
                client.ack(message)
                if len(got) == 5:
                    break
        return got

    asyncio.run(asyncio.wait_for(first_life(), 10))
    broker.restart()  # SIGTERM: both brokers write their store (a kill -9: see test_faults)
    got = asyncio.run(asyncio.wait_for(second_life(), 10))
    assert sorted(got) == [b"delivered-0", b"delivered-1", b"delivered-2", b"queued-0", b"queued-1"]


def test_a_shared_member_that_died_with_a_killed_broker_is_dealt_nothing_after_the_restart(
    broker: EmbeddedBroker,
) -> None:
    """A worker (session expiry 0) in a shared group when the broker is killed is no member
    after the restart: every message reaches the live member. Mochi 2.7.9 restored the dead
    worker's subscription from its store without a session and dropped what it dealt it,
    about half of the gateways' batches after the restart in test_faults' SIGTERM test
    (docs/brokers.md, difference 25; fixed in shoal-mochi)."""
    group, topic, count = "$share/workers/probe/in", "probe/in", 60

    async def dies_with_the_broker() -> None:
        async with AsyncSession(broker.settings, unique_client_id("w-dead")) as worker:
            await worker.subscribe([group])
            broker.kill()

    async def live_member_gets() -> list[bytes]:
        got: list[bytes] = []
        async with AsyncSession(broker.settings, unique_client_id("w-live")) as worker:
            await worker.subscribe([group])
            async with AsyncSession(broker.settings, unique_client_id("gw")) as gateway:
                for i in range(count):
                    await gateway.publish(topic, b"batch-%d" % i)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    async for message in worker.messages():
                        got.append(message.payload)
                        if len(got) == count:
                            break
        return got

    asyncio.run(asyncio.wait_for(dies_with_the_broker(), 10))
    broker.start()
    got = asyncio.run(asyncio.wait_for(live_member_gets(), 20))
    assert sorted(got) == sorted(b"batch-%d" % i for i in range(count)), (
        f"the live member got {len(got)} of {count}"
    )


def test_kill_and_start_again(broker: EmbeddedBroker) -> None:
    pid = broker.pid
    broker.kill()
    assert not broker.running
    broker.start()
    assert broker.pid != pid
    assert _roundtrip(broker, "probe/k") == b"ping"


def test_edge_profile_refuses_anonymous_and_accepts_users(tmp_path) -> None:
    with EmbeddedBroker("edge", data_dir=tmp_path, users={"gw-1": "s3cret"}) as edge:
        anonymous = AsyncSession(edge.settings, unique_client_id("anon"))

        async def connect(session: AsyncSession) -> None:
            async with session:
                pass

        with pytest.raises(BrokerError, match="cannot connect"):
            asyncio.run(connect(anonymous))
        user = AsyncSession(edge.settings.with_credentials("gw-1", "s3cret"), unique_client_id("u"))
        asyncio.run(connect(user))
        assert "s3cret" not in (tmp_path / "passwd").read_text()  # stored hashed


def test_missing_binary_is_one_actionable_sentence(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerNotFoundError) as info:
        EmbeddedBroker(data_dir=tmp_path, broker="mosquitto").start()
    message = str(info.value)
    assert "apt-get install -y mosquitto" in message
    assert "\n" not in message


def test_missing_mochi_binary_is_one_actionable_sentence(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SHOAL_MOCHI_BINARY", str(tmp_path / "shoal-mochi"))
    with pytest.raises(BrokerNotFoundError, match="is not an executable file"):
        EmbeddedBroker(data_dir=tmp_path, broker="mochi").start()
    monkeypatch.delenv("SHOAL_MOCHI_BINARY")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("shoal.broker._mochi.resource_dir", lambda name: tmp_path / name)
    with pytest.raises(BrokerNotFoundError) as info:
        EmbeddedBroker(data_dir=tmp_path, broker="mochi").start()
    assert "make mochi" in str(info.value)
    assert "\n" not in str(info.value)


def test_an_unknown_broker_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown broker 'emqx'"):
        EmbeddedBroker(data_dir=tmp_path, broker="emqx")


def test_unknown_profile_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown broker profile 'nope'"):
        EmbeddedBroker("nope", data_dir=tmp_path).start()


def test_taken_port_is_reported_with_the_log(tmp_path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        broker = EmbeddedBroker(data_dir=tmp_path, port=port, startup_timeout_s=3)
        with pytest.raises(BrokerError, match="did not start") as info:
            broker.start()
    assert "address already in use" in str(info.value).lower()  # Mosquitto and Mochi alike
