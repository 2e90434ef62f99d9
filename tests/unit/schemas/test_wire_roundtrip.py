"""Property tests: whatever the encoder writes, the decoder reads back exactly, in every encoding.

Strings are arbitrary Unicode within the byte limit, timestamps span the whole contract range,
values are every finite float64 (compared bit for bit, so -0.0 stays -0.0), attributes carry
nulls, and batches hold zero or more rows.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.schemas import (
    FRAME_SCHEMA,
    MAX_TS_MS,
    Batch,
    DecodeLimits,
    Encoding,
    Measurements,
    decode_batch,
    encode_batch,
)
from shoal.schemas._checks import GATEWAY_ID_PATTERN

LIMITS = DecodeLimits()
CODECS = [(e, False) for e in Encoding] + [(Encoding.BINARY_COLUMNAR, True)]

strings = st.text(min_size=1, max_size=LIMITS.max_string_bytes).filter(
    lambda s: len(s.encode()) <= LIMITS.max_string_bytes
)
edge_values = st.sampled_from(
    [-0.0, 0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
     -1.7976931348623157e308, 2.0**53 + 2, 0.1, 1e16, 1e-7, 123456789.0]
)  # fmt: skip
values = st.floats(allow_nan=False, allow_infinity=False) | edge_values
timestamps = st.integers(0, MAX_TS_MS) | st.sampled_from([0, 1, MAX_TS_MS, MAX_TS_MS - 1])


@st.composite
def frames(draw: st.DrawFn, max_rows: int = 40) -> pl.DataFrame:
    """A FRAME_SCHEMA frame; ids and attributes reuse a small pool so dictionaries repeat."""
    n = draw(st.integers(0, max_rows))
    ids = draw(st.lists(strings, min_size=1, max_size=8))
    columns: dict[str, list[object]] = {
        "sensor_id": [draw(st.sampled_from(ids)) for _ in range(n)],
        "ts": draw(st.lists(timestamps, min_size=n, max_size=n)),
        "value": draw(st.lists(values, min_size=n, max_size=n)),
    }
    for name in ("name", "type", "unit"):
        pool = draw(st.lists(st.none() | strings, min_size=1, max_size=4))
        columns[name] = [draw(st.sampled_from(pool)) for _ in range(n)]
    return pl.DataFrame(columns, schema=FRAME_SCHEMA)


def assert_same(got: pl.DataFrame, want: pl.DataFrame) -> None:
    assert got.schema == FRAME_SCHEMA
    assert got.height == want.height
    for name in FRAME_SCHEMA.names():
        if name == "value":
            got_bits = got.get_column(name).to_numpy().view(np.uint64)
            want_bits = want.get_column(name).to_numpy().view(np.uint64)
            assert np.array_equal(got_bits, want_bits)
        else:
            assert got.get_column(name).to_list() == want.get_column(name).to_list(), name


envelopes = st.tuples(
    st.from_regex(GATEWAY_ID_PATTERN, fullmatch=True),
    st.integers(0, 2**63 - 1),
    st.integers(0, MAX_TS_MS),
)


@settings(max_examples=150, deadline=None)
@given(frame=frames(), envelope=envelopes)
def test_every_encoding_round_trips_exactly(
    frame: pl.DataFrame, envelope: tuple[str, int, int]
) -> None:
    gateway_id, seq, sent_at = envelope
    for encoding, zstd in CODECS:
        payload = encode_batch(
            frame, gateway_id=gateway_id, seq=seq, sent_at_ms=sent_at, encoding=encoding, zstd=zstd
        )
        # Detection both ways: in-band only, and with the MQTT 5 content type.
        for content_type in (None, encoding.content_type):
            batch = decode_batch(payload, content_type=content_type)
            env = batch.envelope
            assert (env.gateway_id, env.seq, env.sent_at_ms) == envelope
            assert (env.encoding, env.rows, env.version) == (encoding, frame.height, 1)
            assert_same(batch.frame, frame)
            assert_arrays_match(batch)


def assert_arrays_match(batch: Batch) -> None:
    """The arrays and codes a worker groups on say what the frame says."""
    assert batch.rows == batch.frame.height
    assert np.array_equal(batch.ts, batch.frame.get_column("ts").to_numpy())
    value_bits = batch.frame.get_column("value").to_numpy().view(np.uint64)
    assert np.array_equal(batch.value.view(np.uint64), value_bits)
    for name, coded in batch.codes.items():
        assert [coded.values[c] for c in coded.codes] == batch.frame.get_column(name).to_list()


@settings(max_examples=60, deadline=None)
@given(frame=frames(max_rows=60), data=st.data())
def test_slices_of_a_measurements_block_round_trip(
    frame: pl.DataFrame, data: st.DataObject
) -> None:
    # Producers hand in slices that share one dictionary; unused entries must not leak or shift.
    block = Measurements.from_frame(frame)
    start = data.draw(st.integers(0, frame.height))
    stop = data.draw(st.integers(start, frame.height))
    part = block.slice(start, stop)
    for encoding, zstd in CODECS:
        payload = encode_batch(
            part, gateway_id="gw", seq=1, sent_at_ms=0, encoding=encoding, zstd=zstd
        )
        assert_same(decode_batch(payload).frame, part.to_frame())


@pytest.mark.parametrize("encoding", list(Encoding))
def test_a_batch_builds_only_the_columns_asked_for(encoding: Encoding) -> None:
    """``Batch.columns``: the FRAME_SCHEMA columns among those asked, in schema order, equal
    to the whole frame's; on demand (binary columnar) the others are never built."""
    frame = pl.DataFrame(
        {
            "sensor_id": ["a", "b", "a"],
            "ts": [1, 2, 3],
            "value": [1.5, -2.0, 3.25],
            "name": None,
            "type": ["t", None, "u"],
            "unit": "C",
        },
        schema=FRAME_SCHEMA,
    )
    payload = encode_batch(
        Measurements.from_frame(frame), gateway_id="g", seq=1, sent_at_ms=0, encoding=encoding
    )
    batch = decode_batch(payload)
    some = batch.columns({"type", "value", "ts", "nonsense"})
    assert some.columns == ["ts", "value", "type"]
    assert some.equals(frame.select("ts", "value", "type"))
    assert batch.frame.equals(frame)
    assert batch.columns({"unit"}).equals(frame.select("unit"))
