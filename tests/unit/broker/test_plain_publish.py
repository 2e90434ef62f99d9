"""``plain_publish`` builds the bytes of a QoS 0 PUBLISH exactly as ``mqtt5`` does."""

from __future__ import annotations

import mqtt5
import pytest

from shoal.broker._batched import plain_publish


@pytest.mark.parametrize("retain", [True, False])
@pytest.mark.parametrize("size", [0, 1, 120, 121, 124, 125, 16_370, 16_380, 16_400, 2_097_200])
@pytest.mark.parametrize("topic", ["r/p/k", "shoal/results/pipé/gw00-s0001", "t" * 300])
def test_the_same_bytes_as_the_packet_object(topic: str, size: int, *, retain: bool) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    expected = mqtt5.PublishPacket(topic, payload, qos=mqtt5.QoS(0), retain=retain).write()
    assert plain_publish(topic, payload, retain=retain) == bytes(expected)
    packet, read = mqtt5.read(plain_publish(topic, payload, retain=retain))
    assert read == len(expected)
    assert (packet.topic, packet.payload, packet.retain) == (topic, payload, retain)
