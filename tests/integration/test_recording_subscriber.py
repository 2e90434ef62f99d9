"""``mosquitto_sub`` as a recording subscriber: every message back, byte for byte, in order."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shoal.broker import AsyncSession, BrokerSettings, TlsSettings
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.recorder import RecordingSubscriber
from shoal.broker.session import unique_client_id
from shoal.errors import BrokerError
from shoal.schemas.topics import Topics


def test_every_message_comes_back_with_its_topic_retain_flag_and_exact_payload(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    sent = [
        (topics.under_root("a/1"), b'{"x": 1}', False),
        (topics.under_root("a/2"), b"two\nlines\n", False),  # newlines inside a payload
        (topics.under_root("a/3"), b"", False),
        (topics.under_root("a/4"), bytes(range(256)) * 1000, False),  # binary, 256 kB
        (topics.under_root("a/5"), b"99 0 fake/topic 3 abc", False),  # looks like a header
    ]
    retained = (topics.under_root("a/r"), b"kept", True)

    async def publish(messages: list[tuple[str, bytes, bool]]) -> None:
        async with AsyncSession(broker.settings, unique_client_id("pub")) as pub:
            for topic, payload, retain in messages:
                await pub.publish(topic, payload, retain=retain)

    asyncio.run(publish([retained]))
    subscriber = RecordingSubscriber(
        broker.settings, unique_client_id("rec"), [topics.under_root("a/#")], tmp_path / "r.txt"
    )
    subscriber.start()
    began = time.time()
    try:
        asyncio.run(publish(sent))
        deadline = time.monotonic() + 10
        while len(list(subscriber.records())) < len(sent) + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        subscriber.stop()
    records = list(subscriber.records())
    assert [(r.topic, r.payload, r.retain) for r in records] == [retained, *sent]
    assert all(began <= r.at_s <= time.time() for r in records[1:])
    assert [r.at_s for r in records[1:]] == sorted(r.at_s for r in records[1:])


def test_a_tls_broker_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    settings = BrokerSettings(tls=TlsSettings(ca_file=tmp_path / "ca.pem"))
    with pytest.raises(BrokerError, match="plain TCP"):
        RecordingSubscriber(settings, "rec", ["#"], tmp_path / "r.txt")
