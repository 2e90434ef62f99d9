"""``Session.publish_many``'s packets (``_packets.Qos0Packets``) are ``mqtt5``'s, byte for byte.

The combiner's per-key results go through it; their packets used to be ``mqtt5``'s, one per
message. Lengths on both sides of every variable-byte-integer boundary, any topic (non-ASCII
included), with and without a shared head and the retain flag.
"""

from __future__ import annotations

import mqtt5
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.broker._packets import Qos0Packets
from shoal.errors import BrokerError

BOUNDARIES = [0, 1, 126, 127, 128, 129, 16_382, 16_383, 16_384, 2_097_151, 2_097_152]
"""Remaining lengths where the fixed header's length takes one more byte (topic ``t``)."""


def reference(messages: list[tuple[str, bytes]], *, retain: bool, head: bytes) -> bytes:
    qos = mqtt5.QoS(0)
    return b"".join(
        mqtt5.PublishPacket(t, head + p, qos=qos, retain=retain).write() for t, p in messages
    )


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=40).filter(lambda t: not set(t) & set("+#\x00")),
            st.binary(),
        ),
        max_size=20,
    ),
    retain=st.booleans(),
    head=st.binary(max_size=300),
)
def test_packets_are_mqtt5s(messages: list[tuple[str, bytes]], retain: bool, head: bytes) -> None:
    packets = Qos0Packets()
    want = reference(messages, retain=retain, head=head)
    assert packets.build(messages, retain=retain, head=head) == want
    assert packets.build(messages, retain=retain, head=head) == want  # topics remembered


def test_every_length_of_the_remaining_length() -> None:
    # remaining length = 2 (topic length) + 1 (topic "t") + 1 (no properties) + payload
    messages = [("t", bytes(max(n - 4, 0))) for n in BOUNDARIES]
    for retain in (False, True):
        got = Qos0Packets().build(messages, retain=retain, head=b"")
        assert got == reference(messages, retain=retain, head=b"")


def test_a_topic_filter_is_refused_before_anything_is_built() -> None:
    packets = Qos0Packets()
    for topic in ("a/+/b", "a/#", "", "a\x00b"):
        with pytest.raises(BrokerError, match="not a topic name"):
            packets.build([("ok", b"1"), (topic, b"2")], retain=True, head=b"")
