"""One test per machine-readable error ``reason``: the class, reason, field and row it carries.

Each case starts from a valid batch and breaks one rule. The table must name every reason the
wire-format code can raise (a test reads them from the source), so a new reason needs a case.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest
import zstandard

from shoal.errors import DecodeError, InputError, SchemaError
from shoal.schemas import DecodeLimits, decode_batch
from shoal.schemas.control import Confirm
from shoal.schemas.results import parse_window_message

T0 = 1_700_000_000_000
SOURCE = Path(__file__).resolve().parents[3] / "src" / "shoal" / "schemas"
R0 = {"sensor_id": "s1", "ts": T0, "value": 1.5}
R1 = {"sensor_id": "s2", "ts": T0 + 1, "value": 2.5}


def head(enc: str = "json-rows") -> dict[str, Any]:
    return {"shoal": 1, "enc": enc, "gateway_id": "gw-1", "seq": 9, "sent_at": T0}


def json_batch(**changes: Any) -> bytes:
    return orjson.dumps({**head(), "rows": [R0, R1], **changes})


def json_row1(**changes: Any) -> bytes:
    return json_batch(rows=[R0, {**R1, **changes}])


def mp(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def mp_batch(enc: str = "msgpack-rows", **changes: Any) -> bytes:
    return mp({**head(enc), "rows": [R0, R1], **changes})


def columnar(**cols: Any) -> bytes:
    base = {"sensor_id": ["s1", "s2"], "ts": [T0, T0 + 1], "value": [1.5, 2.5]}
    return mp({**head("msgpack-columnar"), "n": 2, "cols": {**base, **cols}})


def binary(comp: str = "none", raw: bytes | None = None, **parts: Any) -> bytes:
    body = {
        "sensor_id": {"dict": ["s1", "s2"], "dtype": "u1", "codes": b"\x00\x01"},
        "ts": {"base": T0, "dtype": "u1", "data": b"\x00\x01"},
        "value": {"dtype": "f8", "data": b"\x00" * 16},
        **parts,
    }
    data = mp(body) if raw is None else raw
    if comp == "zstd" and raw is None:
        data = zstandard.ZstdCompressor().compress(data)
    return mp({**head("binary-columnar"), "n": 2, "comp": comp, "body": data})


@dataclass(frozen=True)
class Case:
    """A payload, how to decode it, and the one error it must give."""

    reason: str
    payload: Callable[[], bytes]
    error: type[InputError]
    field: str | None
    row: int | None = None
    decode: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("empty_payload", lambda: b"", DecodeError, None),
    Case("payload_too_large", json_batch, DecodeError, None,
         decode={"limits": DecodeLimits(max_payload_bytes=10)}),
    Case("bad_content_type", json_batch, DecodeError, "content-type",
         decode={"content_type": "application/xml"}),
    Case("bad_json", lambda: b'{"shoal": 1,', DecodeError, None),
    Case("bad_msgpack", lambda: b"\x85\xa5shoal", DecodeError, None),
    Case("not_a_batch", lambda: orjson.dumps({"rows": []}), DecodeError, "shoal"),
    Case("unsupported_version", lambda: json_batch(shoal=2), DecodeError, "shoal"),
    Case("unknown_encoding", lambda: mp_batch(enc="avro"), DecodeError, "enc"),
    Case("encoding_mismatch", lambda: json_batch(enc="msgpack-rows"), DecodeError, "enc"),
    Case("encoding_mismatch", mp_batch, SchemaError, "enc",
         decode={"content_type": "application/vnd.shoal.v1.binary+msgpack"}),
    Case("unknown_field", lambda: json_row1(quality=3), SchemaError, "quality", 1),
    Case("missing_field", lambda: json_batch(rows=[R0, {"ts": T0, "value": 1.0}]), SchemaError,
         "sensor_id", 1),
    Case("bad_gateway_id", lambda: json_batch(gateway_id="-leading-dash"), SchemaError,
         "gateway_id"),
    Case("bad_type", lambda: json_row1(value="2.5"), SchemaError, "value", 1),
    Case("out_of_range", lambda: json_batch(seq=2**63), SchemaError, "seq"),
    Case("too_many_rows", json_batch, DecodeError, "rows",
         decode={"limits": DecodeLimits(max_rows=1)}),
    Case("length_mismatch", lambda: columnar(ts=[T0]), SchemaError, "ts"),
    Case("not_finite", lambda: mp_batch(rows=[R0, {**R1, "value": -math.inf}]), SchemaError,
         "value", 1),
    Case("ts_in_future", json_batch, SchemaError, "ts", 0, decode={"now_ms": T0 - 300_001}),
    Case("ts_in_past", json_batch, SchemaError, "ts", 0,
         decode={"now_ms": T0 + 11, "limits": DecodeLimits(max_past_ms=10)}),
    Case("null_value", lambda: json_row1(sensor_id=None), SchemaError, "sensor_id", 1),
    Case("empty_string", lambda: json_row1(type=""), SchemaError, "type", 1),
    Case("string_too_long", lambda: json_row1(unit="µ" * 129), DecodeError, "unit", 1),
    Case("bad_compression", lambda: binary(comp="lz4"), DecodeError, "comp"),
    Case("decompressed_too_large", lambda: binary(comp="zstd"), DecodeError, "body",
         decode={"limits": DecodeLimits(max_decompressed_bytes=16)}),
    Case("bad_dtype", lambda: binary(value={"dtype": "f16", "data": b""}), SchemaError,
         "value.dtype"),
    Case("bad_code", lambda: binary(sensor_id={"dict": ["s1"], "dtype": "u1",
                                               "codes": b"\x00\x01"}),
         SchemaError, "sensor_id.codes", 1),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[f"{c.reason}-{c.error.__name__}" for c in CASES])
def test_each_reason_carries_class_field_and_row(case: Case) -> None:
    with pytest.raises(InputError) as info:
        decode_batch(case.payload(), **case.decode)
    err = info.value
    assert type(err) is case.error
    assert (err.reason, err.field, err.row) == (case.reason, case.field, case.row)
    # The message says what and where; the record carries the same for dead letters.
    record = err.as_record()
    assert record["reason"] == case.reason
    assert record["error"] == case.error.__name__
    if case.field is not None:
        assert record["field"] == case.field
        assert repr(case.field) in str(err)
    if case.row is not None:
        assert record["row"] == case.row
        assert f"row {case.row}" in str(err)


def confirm(**changes: Any) -> bytes:
    good = orjson.loads(Confirm("gw-1", "p", 0, 2, 7, T0).to_json())
    return orjson.dumps({**good, **changes})


CONTROL_CASES = [
    ("bad_json", b"{not json", None),
    ("unsupported_version", confirm(shoal=0), "shoal"),
    ("bad_name", confirm(pipeline="a b"), "pipeline"),
    ("bad_type", confirm(seq=None), "seq"),
    ("out_of_range", confirm(partition=2), "partition"),
    ("bad_type", b"[]", "confirm"),
]


@pytest.mark.parametrize(("reason", "payload", "field_"), CONTROL_CASES)
def test_each_control_reason_is_a_schema_error(
    reason: str, payload: bytes, field_: str | None
) -> None:
    with pytest.raises(SchemaError) as info:
        Confirm.from_json(payload)
    assert (info.value.reason, info.value.field, info.value.row) == (reason, field_, None)


RESULT_CASES = [
    ("bad_result_message", b"[1]", None),
    ("bad_result_message", orjson.dumps({"pipeline": 1}), "pipeline"),
]


@pytest.mark.parametrize(("reason", "payload", "field_"), RESULT_CASES)
def test_each_result_message_reason_is_a_schema_error(
    reason: str, payload: bytes, field_: str | None
) -> None:
    with pytest.raises(SchemaError) as info:
        parse_window_message(payload)
    assert (info.value.reason, info.value.field) == (reason, field_)


def test_the_tables_name_every_reason_in_the_source() -> None:
    found = set()
    for path in SOURCE.glob("*.py"):
        found |= set(re.findall(r'reason="([a-z_]+)"', path.read_text("utf-8")))
    assert found == {c.reason for c in CASES} | {c[0] for c in CONTROL_CASES + RESULT_CASES}


def test_both_error_classes_derive_from_input_error() -> None:
    assert issubclass(DecodeError, InputError)
    assert issubclass(SchemaError, InputError)
    assert not issubclass(DecodeError, SchemaError)
