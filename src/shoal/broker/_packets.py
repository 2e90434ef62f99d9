"""QoS 0 PUBLISH packets built in bulk (``Session.publish_many``); no third-party imports.

A combiner at a 1 s step publishes a retained per-key result for every key each second, and
100,000 keys made building them one ``mqtt5.PublishPacket`` at a time, each from a payload
concatenated first (the window's fields, then the key's row), a tenth of its main thread.
Here a packet is the parts joined once: the fixed header with the remaining length, the topic
(encoded once per topic and remembered), an empty property list, the shared ``head`` and the
message's own bytes. The bytes are ``mqtt5``'s exactly (``tests/unit/broker/test_packets.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from shoal.errors import BrokerError

TOPIC_CACHE: Final = 1_000_000
"""Encoded topics remembered at most (then forgotten and encoded again)."""
HEADER_CACHE: Final = 65_536
"""Fixed headers remembered at most, by (retain, remaining length): per-key results of one
pipeline have a few hundred sizes."""


class Qos0Packets:
    """Builds QoS 0 PUBLISH packets without properties (MQTT 5); remembers encoded topics."""

    def __init__(self) -> None:
        self._topics: dict[str, bytes] = {}
        self._headers: dict[int, bytes] = {}

    def build(self, messages: Sequence[tuple[str, bytes]], *, retain: bool, head: bytes) -> bytes:
        """The packets of ``messages`` (topic, payload after ``head``), back to back.

        Raises:
            BrokerError: a topic is no topic name (empty, a wildcard or NUL in it), which the
                broker would answer by closing the connection; nothing is built.
        """
        first = 0x31 if retain else 0x30  # PUBLISH, QoS 0, the retain flag
        topics, headers = self._topics, self._headers
        if len(topics) > TOPIC_CACHE:  # beyond it by one call's messages at most
            topics.clear()
        if len(headers) > HEADER_CACHE:
            headers.clear()
        parts: list[bytes] = []
        add = parts.extend
        shared = len(head)
        for topic, payload in messages:
            encoded = topics.get(topic)
            if encoded is None:
                if not topic or any(c in topic for c in "+#\x00"):
                    raise BrokerError(f"cannot publish to {topic!r}: not a topic name")
                name = topic.encode()
                # topic length, topic, then the property length: no properties
                encoded = topics[topic] = len(name).to_bytes(2, "big") + name + b"\x00"
            size = len(encoded) + shared + len(payload)  # the remaining length
            fixed = headers.get(size << 8 | first)
            if fixed is None:
                fixed = headers[size << 8 | first] = bytes((first, *_varint(size)))
            add((fixed, encoded, head, payload))
        return b"".join(parts)


def _varint(value: int) -> list[int]:
    """MQTT's variable byte integer: 7 bits a byte, least significant first."""
    out = []
    while True:
        value, digit = value >> 7, value & 0x7F
        if not value:
            out.append(digit)
            return out
        out.append(digit | 0x80)
