"""The WebSocket bridge's one piece of MQTT: the CONNECT it reads to admit dashboard users."""

from __future__ import annotations

import pytest

from shoal.broker.websocket import (
    MalformedConnectError,
    connect_user,
    packet_length,
    refusal,
)


def connect_packet(
    level: int, user: str | None, *, will: bool = False, properties: bytes = b""
) -> bytes:
    def sized(data: bytes) -> bytes:
        return len(data).to_bytes(2, "big") + data

    flags = 0x02 | (0x80 | 0x40 if user is not None else 0) | (0x04 if will else 0)
    name = b"MQIsdp" if level == 3 else b"MQTT"
    head = sized(name) + bytes([level, flags]) + (60).to_bytes(2, "big")
    if level == 5:
        head += bytes([len(properties)]) + properties
    body = sized(b"browser-1")
    if will:
        body += (b"\x00" if level == 5 else b"") + sized(b"will/topic") + sized(b"gone")
    if user is not None:
        body += sized(user.encode()) + sized(b"secret")
    rest = head + body
    length, encoded = len(rest), b""
    while True:
        byte, length = length % 128, length // 128
        encoded += bytes([byte | (0x80 if length else 0)])
        if not length:
            break
    return bytes([0x10]) + encoded + rest


@pytest.mark.parametrize("level", [3, 4, 5])
@pytest.mark.parametrize("will", [False, True])
def test_the_user_name_is_read_from_every_protocol_level(level: int, will: bool) -> None:
    packet = connect_packet(level, "grafana", will=will, properties=b"\x21\x00\x0a")
    assert packet_length(packet + b"next packet") == len(packet)
    assert connect_user(packet) == (level, "grafana")
    assert connect_user(connect_packet(level, None, will=will)) == (level, None)


def test_a_packet_split_across_messages_is_waited_for() -> None:
    packet = connect_packet(5, "x" * 200)  # a two-byte remaining length
    assert packet[2] != 0  # the second length byte
    for cut in (0, 1, 2, 3, len(packet) - 1):
        assert packet_length(packet[:cut]) is None
    assert packet_length(packet) == len(packet)


@pytest.mark.parametrize(
    ("packet", "why"),
    [
        (b"\x30\x02\x00\x00", "not a CONNECT"),
        (b"\x10\x05\x00\x04MQ", "ends early"),
        (b"\x10\x07\x00\x04MQTT\x09", "protocol level 9"),
    ],
)
def test_anything_else_is_refused_with_a_reason(packet: bytes, why: str) -> None:
    with pytest.raises(MalformedConnectError, match=why):
        connect_user(packet)


def test_a_remaining_length_longer_than_mqtt_allows_is_refused() -> None:
    with pytest.raises(MalformedConnectError, match="longer than 4 bytes"):
        packet_length(b"\x10\xff\xff\xff\xff\x01")


def test_the_refusal_is_a_connack_not_authorized_of_the_clients_level() -> None:
    assert refusal(5) == bytes([0x20, 0x03, 0x00, 0x87, 0x00])  # reason code 0x87
    assert refusal(4) == bytes([0x20, 0x02, 0x00, 0x05])  # return code 5
