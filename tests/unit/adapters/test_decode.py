"""Device payloads → rows, and refusals that say format, expected, found and where."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from shoal.adapters import Decoder, parse_mapping
from shoal.errors import DecodeError, InputError, SchemaError

NOW = 1_700_000_000_000
LEVELS = {"site": "berlin", "device": "d1"}
TOPIC = "sensors/berlin/d1"


def _decoder(**route: Any) -> Decoder:
    settings = {"topic": "sensors/{site}/{device}", "format": "json-object", **route}
    return Decoder(parse_mapping({"routes": [settings]}).routes[0])


def test_json_object_one_row_per_field() -> None:
    decoder = _decoder(timestamp={"field": "ts", "unit": "ms"}, units={"temp": "C"})
    rows = decoder.decode(TOPIC, LEVELS, b'{"temp": 21.5, "hum": 40, "ts": 1700000000123}', NOW)
    assert rows == [
        ("berlin.d1", 1_700_000_000_123, 21.5, "temp", None, "C"),
        ("berlin.d1", 1_700_000_000_123, 40.0, "hum", None, None),
    ]


def test_field_selection_booleans_and_arrival_time() -> None:
    decoder = _decoder(fields=["on", "temp"])
    rows = decoder.decode(TOPIC, LEVELS, b'{"temp": 1, "on": true, "other": "x"}', NOW)
    assert rows == [
        ("berlin.d1", NOW, 1.0, "on", None, None),
        ("berlin.d1", NOW, 1.0, "temp", None, None),
    ]


@pytest.mark.parametrize(
    ("unit", "value", "ms"),
    [
        ("s", 1_700_000_000.5, 1_700_000_000_500),
        ("ms", 1_700_000_000_123, 1_700_000_000_123),
        ("us", 1_700_000_000_123_456, 1_700_000_000_123),
        ("iso8601", "2023-11-14T22:13:20.123Z", 1_700_000_000_123),
        ("iso8601", "2023-11-14T23:13:20.123+01:00", 1_700_000_000_123),
    ],
)
def test_timestamp_units(unit: str, value: Any, ms: int) -> None:
    decoder = _decoder(timestamp={"field": "t", "unit": unit})
    rows = decoder.decode(TOPIC, LEVELS, orjson.dumps({"t": value, "v": 1}), NOW + 10_000)
    assert rows[0][1] == ms


def test_json_array_of_objects() -> None:
    decoder = _decoder(format="json-array", timestamp={"field": "ts"})
    rows = decoder.decode(TOPIC, LEVELS, b'[{"v": 1, "ts": 5}, {"v": 2, "ts": 6}]', NOW)
    assert [(r[1], r[2]) for r in rows] == [(5, 1.0), (6, 2.0)]


def test_raw_values() -> None:
    decoder = Decoder(
        parse_mapping(
            {"routes": [{"topic": "home/{room}/{metric}", "format": "raw", "name": "{metric}"}]}
        ).routes[0]
    )
    levels = {"room": "kitchen", "metric": "temp"}
    assert decoder.decode("home/kitchen/temp", levels, b" 21.5\n", NOW) == [
        ("kitchen.temp", NOW, 21.5, "temp", None, None)
    ]
    assert decoder.decode("home/kitchen/temp", levels, b"true", NOW)[0][2] == 1.0


@pytest.mark.parametrize(
    ("route", "payload", "reason", "field", "found"),
    [
        ({}, b"temp=21", "not_json", None, "b'temp=21'"),
        ({}, b"[1]", "not_an_object", None, "array [1]"),
        ({}, b'{"temp": "warm"}', "string_metric", "temp", "string 'warm'"),
        ({}, b'{"temp": null}', "null_metric", "temp", "null None"),
        ({}, b'{"temp": {"v": 1}}', "nested_metric", "temp", 'object {"v":1}'),
        ({}, b"{}", "no_metrics", None, "an empty object"),
        ({"timestamp": {"field": "ts"}}, b'{"v": 1}', "missing_timestamp", "ts", "fields"),
        ({"timestamp": {"field": "ts"}}, b'{"v": 1, "ts": "x"}', "bad_timestamp", "ts", "'x'"),
        ({"timestamp": {"field": "ts"}}, b'{"v": 1, "ts": -5}', "out_of_range", "ts", "-5"),
        (
            {"timestamp": {"field": "ts"}},
            b'{"v": 1, "ts": 1800000000000}',
            "ts_in_future",
            "ts",
            "18",
        ),
        (
            {"timestamp": {"field": "ts", "unit": "iso8601"}},
            b'{"v": 1, "ts": "2023-11-14T22:13:20"}',
            "bad_timestamp",
            "ts",
            "2023-11-14T22:13:20",
        ),
        ({"format": "json-array"}, b'[{"v": 1}, 3]', "not_an_object", None, "integer 3"),
        ({"format": "json-array"}, b"[]", "no_metrics", None, "an empty array"),
        ({"sensor_id": "{device}" + "x" * 300}, b'{"v": 1}', "string_too_long", "sensor_id", ""),
    ],
)
def test_refusals_are_specific(
    route: dict[str, Any], payload: bytes, reason: str, field: str | None, found: str
) -> None:
    decoder = _decoder(**route)
    with pytest.raises(InputError) as caught:
        decoder.decode(TOPIC, LEVELS, payload, NOW)
    error = caught.value
    assert isinstance(error, DecodeError | SchemaError)
    assert error.reason == reason
    assert error.field == field
    assert found in (error.found or "")
    text = str(error)
    assert text.startswith(decoder.format)  # the format assumed
    assert TOPIC in text  # where
    assert error.expected  # what was expected


def test_not_json_offset_is_the_byte_where_it_fails() -> None:
    """CONTRACT §18.1: ``offset`` counts bytes (orjson's position counts characters)."""
    decoder = _decoder()
    for payload, offset in [('{"naïve": x}'.encode(), 11), (b'{"a": \xff}', 6)]:
        with pytest.raises(DecodeError) as caught:
            decoder.decode(TOPIC, LEVELS, payload, NOW)
        assert caught.value.reason == "not_json"
        assert caught.value.offset == offset, payload
        assert f"at byte {offset} " in str(caught.value)


def test_strings_can_be_skipped() -> None:
    decoder = _decoder(strings="skip")
    assert decoder.decode(TOPIC, LEVELS, b'{"state": "ok", "v": 2}', NOW) == [
        ("berlin.d1", NOW, 2.0, "v", None, None)
    ]


def test_raw_refusals() -> None:
    decoder = Decoder(
        parse_mapping({"routes": [{"topic": "home/{room}/{metric}", "format": "raw"}]}).routes[0]
    )
    levels = {"room": "k", "metric": "t"}
    for payload, reason in [
        (b"warm", "string_metric"),
        (b"", "empty_payload"),
        (b"\xff\xfe", "not_utf8"),
        (b"nan", "not_finite"),
        (b"1e999", "not_finite"),
    ]:
        with pytest.raises(InputError) as caught:
            decoder.decode("home/k/t", levels, payload, NOW)
        assert caught.value.reason == reason, payload
