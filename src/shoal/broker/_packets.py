"""QoS 0 PUBLISH packets built in bulk (``Session.publish_many``); no third-party imports.

A combiner at a 1 s step publishes a retained per-key result for every key each second, and
100,000 keys made building them one ``mqtt5.PublishPacket`` at a time, each from a payload
concatenated first (the window's fields, then the key's row), a tenth of its main thread.
Here a packet is the parts joined once: the fixed header with the remaining length, the topic
(encoded once per topic and remembered), an empty property list, the shared ``head`` and the
message's own bytes. The bytes are ``mqtt5``'s exactly (``tests/unit/broker/test_packets.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Final, cast

from shoal.errors import BrokerError

TOPIC_CACHE: Final = 1_000_000
"""Encoded topics remembered at most (then forgotten and encoded again)."""
HEADER_TABLES: Final = 64
"""Tables of fixed headers remembered at most, one per (retain flag, shared head's length)."""
HEADER_CACHE: Final = 65_536
"""Fixed headers remembered at most per table, by remaining length: per-key results of one
pipeline have a few hundred sizes."""


class Qos0Packets:
    """Builds QoS 0 PUBLISH packets without properties (MQTT 5); remembers encoded topics."""

    def __init__(self) -> None:
        self._topics: dict[str, bytes] = {}
        self._headers: dict[tuple[int, int], dict[int, bytes]] = {}
        """Fixed headers by (first byte, shared head's length), then by the length of the
        topic and the message's own bytes."""

    def build(self, messages: Sequence[tuple[str, bytes]], *, retain: bool, head: bytes) -> bytes:
        """The packets of ``messages`` (topic, payload after ``head``), back to back.

        Raises:
            BrokerError: a topic is no topic name (empty, a wildcard or NUL in it), which the
                broker would answer by closing the connection; nothing is built.
        """
        if not messages:
            return b""
        names, payloads = zip(*messages, strict=True)
        return self.build_columns(names, payloads, retain=retain, head=head)

    def build_columns(
        self, topics: Sequence[str], payloads: Sequence[bytes], *, retain: bool, head: bytes
    ) -> bytes:
        """``build`` of ``zip(topics, payloads)``, column by column.

        Each pass is a ``map`` in C: a loop in Python per message, and a tuple per message
        for the garbage collector to walk, were most of the cost at 100,000 messages a step
        (docs/benchmarks.md, branch slpub).

        Raises:
            BrokerError: as ``build``.
        """
        first = 0x31 if retain else 0x30  # PUBLISH, QoS 0, the retain flag
        cache = self._topics
        if len(cache) > TOPIC_CACHE:  # beyond it by one call's messages at most
            cache.clear()
        if len(self._headers) > HEADER_TABLES:
            self._headers.clear()
        headers = self._headers.setdefault((first, len(head)), {})
        if len(headers) > HEADER_CACHE:
            headers.clear()
        if not topics:
            return b""
        found = list(map(cache.get, topics))
        encoded = cast("list[bytes]", found)
        if None in found:
            pairs = zip(topics, found, strict=True)
            encoded = [e if e is not None else self._encode(t) for t, e in pairs]
        # the remaining length less the shared head's: the fixed header's key in ``headers``
        sizes = list(map(operator.add, map(len, encoded), map(len, payloads)))
        fixed = list(map(headers.get, sizes))
        if None in fixed:
            by_size = zip(sizes, fixed, strict=True)
            fixed = [
                f if f is not None else _fixed(headers, first, s, len(head)) for s, f in by_size
            ]
        parts: list[bytes | None] = [None] * (4 * len(fixed))
        parts[0::4] = fixed
        parts[1::4] = encoded
        parts[2::4] = repeat(head, len(fixed))
        parts[3::4] = payloads
        return b"".join(parts)  # type: ignore[arg-type]

    def _encode(self, topic: str) -> bytes:
        """The topic as a PUBLISH carries it, remembered.

        Raises:
            BrokerError: not a topic name.
        """
        if not topic or any(c in topic for c in "+#\x00"):
            raise BrokerError(f"cannot publish to {topic!r}: not a topic name")
        name = topic.encode()
        # topic length, topic, then the property length: no properties
        encoded = self._topics[topic] = len(name).to_bytes(2, "big") + name + b"\x00"
        return encoded


def _fixed(headers: dict[int, bytes], first: int, size: int, shared: int) -> bytes:
    """The fixed header for a remaining length of ``size`` + ``shared``, kept by ``size``."""
    fixed = headers[size] = bytes((first, *_varint(size + shared)))
    return fixed


def _varint(value: int) -> list[int]:
    """MQTT's variable byte integer: 7 bits a byte, least significant first."""
    out = []
    while True:
        value, digit = value >> 7, value & 0x7F
        if not value:
            out.append(digit)
            return out
        out.append(digit | 0x80)
