"""The per-key messages built as columns (``key_columns``, ``key_rests``) are ``key_payloads``'.

And their packets, built from columns with the combiner's per-key topics (keys that need
escaping included), are ``mqtt5``'s, byte for byte: random frames with null keys, NaN and
null values, corrections, and the window split into parts.
"""

from __future__ import annotations

import math

import mqtt5
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.broker._packets import Qos0Packets
from shoal.processors.result_parts import split_result
from shoal.processors.results import (
    WindowResult,
    json_rows,
    key_columns,
    key_payloads,
    key_rests,
    ndjson_rows,
)
from shoal.schemas.results import RETRACTED
from shoal.schemas.topics import Topics

keys = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["a/b", "+", "#", "_x", "", "x\x00y", "{", '"{', "\n{", "é€"]),
)
values = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=False),
    st.sampled_from([math.nan, -0.0, 1e300, 5e-324]),
)


@st.composite
def results(draw: st.DrawFn) -> WindowResult:
    n = draw(st.integers(0, 25))
    frame = pl.DataFrame(
        {
            "key": draw(st.lists(keys, min_size=n, max_size=n)),
            "rows": draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)),
            "mean": draw(st.lists(values, min_size=n, max_size=n)),
            "p99": draw(st.lists(values, min_size=n, max_size=n)),
        },
        schema={"key": pl.String, "rows": pl.Int64, "mean": pl.Float64, "p99": pl.Float64},
    )
    return WindowResult(
        "sliding-10s-1s",
        draw(st.integers(-(2**50), 2**50)),
        draw(st.integers(-(2**50), 2**50)),
        frame,
        revision=draw(st.integers(1, 3)),
    )


@settings(max_examples=150, deadline=None)
@given(result=results(), at=st.integers(0, 2**45))
def test_key_columns_are_key_payloads(result: WindowResult, at: int) -> None:
    lines = ndjson_rows(result)
    head, pairs = key_payloads(result, "p", at)
    got_head, got_keys, got_rests = key_columns(result, "p", at, lines)
    if not pairs:
        assert (got_keys, got_rests) == ([], [])
        return
    assert got_head == head
    assert list(zip(got_keys, got_rests, strict=True)) == pairs
    assert key_rests(lines) == [line[1:] for line in lines.splitlines()]


@settings(max_examples=100, deadline=None)
@given(result=results(), at=st.integers(0, 2**45), budget=st.integers(40, 2_000))
def test_packets_of_each_part_are_mqtt5s(result: WindowResult, at: int, budget: int) -> None:
    """Every part of a split window (as the combiner splits it), published per key."""
    topics, packets = Topics(), Qos0Packets()
    lines = ndjson_rows(result)
    split = split_result(result, budget, lines=lines.splitlines())
    for part in split.parts:
        head, names, rests = key_columns(part, "p", at, ndjson_rows(part))
        per_key = [topics.result_key("p", k) for k in names]
        want = b"".join(
            mqtt5.PublishPacket(t, head + r, qos=mqtt5.QoS(0), retain=True).write()
            for t, r in zip(per_key, rests, strict=True)
        )
        assert packets.build_columns(per_key, rests, retain=True, head=head) == want
    assert json_rows(result, lines) == json_rows(result)


def test_a_session_frame_is_refused() -> None:
    frame = pl.DataFrame({"key": ["a"], "end": [5], "rows": [1]})
    with pytest.raises(ValueError, match="own ends"):
        key_columns(
            WindowResult("s", 0, 5, frame), "p", 0, ndjson_rows(WindowResult("s", 0, 5, frame))
        )
    retracted = pl.DataFrame({"key": ["a"], "rows": [1], RETRACTED: [None]})
    with pytest.raises(ValueError, match="own ends"):
        key_columns(WindowResult("s", 0, 5, retracted), "p", 0, b"")
