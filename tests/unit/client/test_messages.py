"""Parsing result messages into the result layout, from the bytes combiners publish."""

from __future__ import annotations

import math

import polars as pl
import pytest

from shoal.client import empty_results, parse_key_message, parse_window_message, to_pandas
from shoal.client.messages import key_records_frame
from shoal.errors import SchemaError
from shoal.processors.results import (
    Emission,
    WindowResult,
    key_messages,
    window_json,
    window_msgpack,
)
from shoal.schemas.results import HEADER_SCHEMA

T0 = 1_700_000_000_000


def result() -> WindowResult:
    frame = pl.DataFrame(
        {
            "key": ["a", "b", None],
            "rows": [3, 1, 2],
            "batches": [2, 1, 1],
            "count": [3, 1, 2],
            "mean": [0.1 + 0.2, 1 / 3, -2.5],
            "stddev": [0.5, None, 1e-300],
            "p95": [1.0, 2.0, 3.0],
        }
    )
    return WindowResult("tumbling-10s", T0, T0 + 10_000, frame)


CTX = Emission("p", partition=1, partitions=2, watermark=T0 + 12_000, emitted_at_ms=T0 + 12_001)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_both_encodings_parse_to_the_same_frame(encoding: str) -> None:
    if encoding == "json":
        message = parse_window_message(window_json(result(), CTX), "application/json")
    else:
        message = parse_window_message(window_msgpack(result(), CTX), "application/msgpack")
    assert message.identity == ("p", "tumbling-10s", T0, 1, 1, 0)
    assert (message.part, message.parts) == (0, 1)  # a whole window
    assert (message.end, message.partitions, message.watermark) == (T0 + 10_000, 2, T0 + 12_000)
    assert message.rows == 6
    frame = message.frame
    assert frame.columns == [
        *HEADER_SCHEMA.names(),
        "key",
        "rows",
        "batches",
        "count",
        "mean",
        "stddev",
        "p95",
    ]
    assert frame.schema["count"] == pl.Int64
    assert frame.schema["mean"] == pl.Float64
    assert frame["key"].to_list() == ["a", "b", None]
    assert frame["mean"].to_list() == [0.1 + 0.2, 1 / 3, -2.5]  # exact round trip
    assert frame["stddev"].to_list() == [0.5, None, 1e-300]


def test_content_type_is_optional() -> None:
    assert parse_window_message(window_json(result(), CTX)).rows == 6
    assert parse_window_message(window_msgpack(result(), CTX)).rows == 6


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"{nope",
        b"[1, 2]",
        b'{"shoal": 1, "pipeline": "p"}',
        b'{"shoal":1,"pipeline":"p","window":"w","start":"x","end":1,"revision":1,'
        b'"partition":0,"partitions":1,"watermark":null,"emitted_at":1,"results":[]}',
        b'{"shoal":1,"pipeline":"p","window":"w","start":0,"end":1,"revision":1,'
        b'"partition":0,"partitions":1,"watermark":null,"emitted_at":1,"results":[{"x":1}]}',
        b'{"shoal":1,"pipeline":"p","window":"w","start":0,"end":1,"revision":1,'
        b'"partition":0,"partitions":1,"watermark":null,"emitted_at":1}',
    ],
)
def test_bad_messages_raise_schema_errors(payload: bytes) -> None:
    with pytest.raises(SchemaError):
        parse_window_message(payload)


def test_per_key_messages() -> None:
    records = [parse_key_message(line) for _, line in key_messages(result(), "p", T0)]
    assert [r["key"] for r in records] == ["a", "b", None]
    frame = key_records_frame(records)
    assert frame["key"].to_list() == ["a", "b", None]
    assert frame.schema["rows"] == pl.Int64
    assert frame.schema["start"] == pl.Int64
    assert frame["mean"][0] == 0.1 + 0.2
    with pytest.raises(SchemaError):
        parse_key_message(b'{"key": "a"}')
    assert key_records_frame([]).height == 0


def test_empty_results_and_pandas() -> None:
    empty = empty_results(("count", "mean"))
    assert empty.height == 0
    assert empty.schema["count"] == pl.Int64
    frame = parse_window_message(window_json(result(), CTX)).frame
    table = to_pandas(frame)
    assert list(table.columns) == frame.columns
    assert table["mean"].tolist()[0] == 0.1 + 0.2
    assert math.isnan(table["stddev"].tolist()[1])
