"""Golden payloads that must be refused, each with the exact error: class, reason, field, row.

Every case breaks one rule of a valid two-row batch (``R0``, ``R1``), so the error it must
give is unambiguous.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Final

import msgpack
from _wire import MAX_TS, T0, VENDOR, Row, buffer, header, pack, zstd

DE: Final = "DecodeError"
SE: Final = "SchemaError"
DROP: Final = object()
"""Marks a key to leave out of a map built by changing a valid one."""


@dataclass
class Invalid:
    """A payload that must be refused, and the exact error.

    ``schema_expressible`` is set for JSON that parses: whether ``batch.schema.json`` alone
    refuses it (limits, clocks and content types are beyond a JSON Schema).
    """

    name: str
    payload: bytes
    error: str
    reason: str
    field: str | None = None
    row: int | None = None
    content_type: str | None = None
    limits: Row = dataclasses.field(default_factory=dict)
    now_ms: int | None = None
    schema_expressible: bool | None = None
    note: str = ""

    @property
    def path(self) -> str:
        """Where the payload lives below ``schemas/golden``."""
        return f"invalid/{self.name}"


R0: Final = {"sensor_id": "s1", "ts": T0, "value": 1.5}
R1: Final = {"sensor_id": "s2", "ts": T0 + 1, "value": 2.5}
COLS: Final = {"sensor_id": ["s1", "s2"], "ts": [T0, T0 + 1], "value": [1.5, 2.5]}
GOOD_BODY: Final = {
    "sensor_id": {"dict": ["s1", "s2"], "dtype": "u1", "codes": b"\x00\x01"},
    "ts": {"base": T0, "dtype": "u1", "data": b"\x00\x01"},
    "value": {"dtype": "f8", "data": buffer("f8", [1.5, 2.5])},
}
SID: Final = GOOD_BODY["sensor_id"]
EXT: Final = msgpack.ExtType(1, b"x")


def _changed(base: Row, changes: Row) -> Row:
    merged = base | changes
    return {k: v for k, v in merged.items() if v is not DROP}


def jdoc(**changes: Any) -> bytes:
    """The valid JSON rows batch with top-level keys changed (``DROP`` removes one)."""
    return json.dumps(_changed({**header("json-rows", 1), "rows": [R0, R1]}, changes)).encode()


def jrow(index: int, **changes: Any) -> bytes:
    """The valid JSON rows batch with keys of row ``index`` changed."""
    rows = [R0, R1]
    rows[index] = _changed(rows[index], changes)
    return jdoc(rows=rows)


def mdoc(enc: str = "msgpack-rows", **changes: Any) -> bytes:
    """The valid MsgPack rows batch (or another MsgPack encoding) with keys changed."""
    return pack(_changed({**header(enc, 1), "rows": [R0, R1]}, changes))


def mrow(index: int, **changes: Any) -> bytes:
    """The valid MsgPack rows batch with keys of row ``index`` changed."""
    rows = [R0, R1]
    rows[index] = _changed(rows[index], changes)
    return mdoc(rows=rows)


def cdoc(**cols: Any) -> bytes:
    """The valid MsgPack columnar batch with columns changed."""
    return mdoc("msgpack-columnar", rows=DROP, n=2, cols=_changed(COLS, cols))


def bdoc(parts: Row | None = None, *, raw: bytes | None = None, **changes: Any) -> bytes:
    """The valid binary columnar batch with body ``parts``, the ``raw`` body, or keys changed."""
    data = raw if raw is not None else pack(_changed(GOOD_BODY, parts or {}))
    top = {**header("binary-columnar", 1), "n": 2, "comp": "none", "body": data}
    return pack(_changed(top, changes))


def framing_cases() -> list[Invalid]:
    """Framing, syntax, detection and the envelope."""
    ok, bad = jdoc(), Invalid
    return [
        bad("empty-payload.bin", b"", DE, "empty_payload"),
        bad("payload-too-large.json", ok, DE, "payload_too_large", schema_expressible=False,
            limits={"max_payload_bytes": 64}),
        bad("bad-content-type.json", ok, DE, "bad_content_type", "content-type",
            content_type="text/plain", schema_expressible=False),
        bad("bad-json-truncated.json", ok[:-5], DE, "bad_json"),
        bad("bad-json-nan.json", ok.replace(b"1.5", b"NaN"), DE, "bad_json", note="not JSON"),
        bad("bad-json-utf8.json", ok.replace(b'"s1"', b'"s\xff"'), DE, "bad_json",
            note="invalid UTF-8"),
        bad("bad-msgpack-truncated.msgpack", mdoc()[:-3], DE, "bad_msgpack"),
        bad("bad-msgpack-trailing.msgpack", mdoc() + b"\xc0", DE, "bad_msgpack",
            note="a byte after the top-level map"),
        bad("bad-msgpack-int-key.msgpack", b"\x81\x01\x02", DE, "bad_msgpack",
            note="map keys must be strings"),
        bad("top-level-array.json", b" [1, 2]", SE, "bad_type", "the batch",
            schema_expressible=True),
        bad("not-a-map.msgpack", pack([1, 2]), SE, "bad_type", "the batch"),
        bad("not-a-batch.json", b'{"hello": "world"}', DE, "not_a_batch", "shoal",
            schema_expressible=True),
        bad("unsupported-version.json", jdoc(shoal=2), DE, "unsupported_version", "shoal",
            schema_expressible=True),
        bad("unsupported-version-bool.msgpack", mdoc(shoal=True), DE, "unsupported_version",
            "shoal"),
        bad("unknown-encoding.msgpack", mdoc(enc="csv"), DE, "unknown_encoding", "enc"),
        bad("unknown-encoding.json", jdoc(enc="json"), DE, "unknown_encoding", "enc",
            schema_expressible=True, note="the short aliases are for the CLI, never the wire"),
        bad("encoding-mismatch-in-band.json", jdoc(enc="msgpack-rows"), DE, "encoding_mismatch",
            "enc", schema_expressible=True, note="JSON text naming a MsgPack encoding"),
        bad("encoding-mismatch-columnar-in-json.json",
            jdoc(enc="msgpack-columnar", rows=DROP, n=2, cols=COLS), DE, "encoding_mismatch",
            "enc", schema_expressible=True, note="JSON text with a columnar body"),
        bad("encoding-mismatch-in-band.msgpack", mdoc(enc="json-rows"), DE, "encoding_mismatch",
            "enc", note="MsgPack naming json-rows"),
        bad("encoding-mismatch-content-type.msgpack", mdoc(), SE, "encoding_mismatch", "enc",
            content_type=VENDOR["msgpack-columnar"]),
        bad("unknown-field-envelope.json", jdoc(priority=1), SE, "unknown_field", "priority",
            schema_expressible=True),
        bad("missing-field-envelope.json", jdoc(sent_at=DROP), SE, "missing_field", "sent_at",
            schema_expressible=True),
        bad("bad-gateway-id.json", jdoc(gateway_id="site/7"), SE, "bad_gateway_id",
            "gateway_id", schema_expressible=True),
        bad("bad-gateway-id-long.msgpack", mdoc(gateway_id="g" * 129), SE, "bad_gateway_id",
            "gateway_id"),
        bad("seq-negative.json", jdoc(seq=-1), SE, "out_of_range", "seq",
            schema_expressible=True),
        bad("seq-float.json", ok.replace(b'"seq": 1,', b'"seq": 1.0,'), SE, "bad_type", "seq",
            schema_expressible=False,
            note="JSON Schema counts 1.0 as an integer; the contract does not"),
        bad("sent-at-string.json", jdoc(sent_at="2024-01-01"), SE, "bad_type", "sent_at",
            schema_expressible=True),
        bad("seq-ext.msgpack", mdoc(seq=EXT), SE, "bad_type", "seq",
            note="MsgPack extension types are never valid"),
    ]  # fmt: skip


def rows_cases() -> list[Invalid]:
    """The rows encodings: row shape, types, values, strings, timestamps, limits."""
    ok, bad = jdoc(), Invalid
    return [
        bad("rows-not-array.json", jdoc(rows={"0": R0}), SE, "bad_type", "rows",
            schema_expressible=True),
        bad("row-not-map.json", jdoc(rows=[R0, [1]]), SE, "bad_type", "rows", 1,
            schema_expressible=True),
        bad("unknown-field-row.json", jrow(1, quality="good"), SE, "unknown_field", "quality", 1,
            schema_expressible=True),
        bad("missing-field-row.msgpack", mrow(1, value=DROP), SE, "missing_field", "value", 1),
        bad("ts-string.json", jrow(1, ts="2024-01-01T00:00:00Z"), SE, "bad_type", "ts", 1,
            schema_expressible=True),
        bad("ts-float.msgpack", mrow(1, ts=float(T0)), SE, "bad_type", "ts", 1),
        bad("value-bool.json", jrow(1, value=True), SE, "bad_type", "value", 1,
            schema_expressible=True),
        bad("value-string.msgpack", mrow(0, value="1.5"), SE, "bad_type", "value", 0),
        bad("value-ext.msgpack", mrow(1, value=EXT), SE, "bad_type", "value", 1,
            note="MsgPack extension types are never valid"),
        bad("ts-timestamp-ext.msgpack", mrow(1, ts=msgpack.Timestamp(1_700_000_000, 0)), SE,
            "bad_type", "ts", 1, note="the MsgPack timestamp extension is not an integer"),
        bad("attribute-number.json", jrow(1, unit=7), SE, "bad_type", "unit", 1,
            schema_expressible=True),
        bad("sensor-id-null.json", jrow(1, sensor_id=None), SE, "null_value", "sensor_id", 1,
            schema_expressible=True),
        bad("sensor-id-empty.msgpack", mrow(1, sensor_id=""), SE, "empty_string", "sensor_id", 1),
        bad("attribute-empty.json", jrow(0, name=""), SE, "empty_string", "name", 0,
            schema_expressible=True),
        bad("sensor-id-too-long.json", jrow(1, sensor_id="é" * 129), DE, "string_too_long",
            "sensor_id", 1, schema_expressible=False,
            note="258 UTF-8 bytes: the limit counts bytes and is configurable"),
        bad("value-infinite.msgpack", mrow(1, value=math.inf), SE, "not_finite", "value", 1),
        bad("value-nan.msgpack", mrow(0, value=math.nan), SE, "not_finite", "value", 0),
        bad("ts-negative.json", jrow(1, ts=-1), SE, "ts_in_past", "ts", 1,
            schema_expressible=True),
        bad("ts-beyond-2p53.json", jrow(1, ts=2**53), SE, "ts_in_future", "ts", 1,
            schema_expressible=True),
        bad("ts-beyond-int64.msgpack", mrow(1, ts=2**64 - 1), SE, "out_of_range", "ts", 1),
        bad("ts-future-clock.json", ok, SE, "ts_in_future", "ts", 1, now_ms=T0 - 300_000,
            schema_expressible=False,
            note="row 1 lies 300001 ms after now_ms; the default max_future_ms is 300000"),
        bad("ts-past-clock.json", ok, SE, "ts_in_past", "ts", 0, now_ms=T0 + 60_001,
            limits={"max_past_ms": 60_000}, schema_expressible=False),
        bad("too-many-rows.json", ok, DE, "too_many_rows", "rows", limits={"max_rows": 1},
            schema_expressible=False),
    ]  # fmt: skip


def columnar_cases() -> list[Invalid]:
    """MsgPack columnar."""
    bad = Invalid
    return [
        bad("columnar-missing-cols.msgpack", mdoc("msgpack-columnar", rows=DROP, n=2), SE,
            "missing_field", "cols"),
        bad("columnar-n-negative.msgpack", mdoc("msgpack-columnar", rows=DROP, n=-1, cols=COLS),
            SE, "out_of_range", "n"),
        bad("columnar-length-mismatch.msgpack", cdoc(value=[1.5]), SE, "length_mismatch",
            "value"),
        bad("columnar-too-many-rows.msgpack", cdoc(), DE, "too_many_rows", "n",
            limits={"max_rows": 1}),
        bad("columnar-unknown-column.msgpack", cdoc(quality=[1, 2]), SE, "unknown_field",
            "quality"),
        bad("columnar-missing-column.msgpack", cdoc(ts=DROP), SE, "missing_field", "ts"),
        bad("columnar-not-array.msgpack", cdoc(ts=T0), SE, "bad_type", "ts"),
        bad("columnar-sensor-id-null.msgpack", cdoc(sensor_id=["s1", None]), SE, "null_value",
            "sensor_id", 1),
        bad("columnar-ts-ext.msgpack", cdoc(ts=[T0, EXT]), SE, "bad_type", "ts", 1,
            note="MsgPack extension types are never valid"),
        bad("columnar-value-all-ext.msgpack", cdoc(value=[EXT, EXT]), SE, "bad_type", "value", 0,
            note="a column of extension values only"),
    ]  # fmt: skip


def binary_cases() -> list[Invalid]:
    """Binary columnar: compression, buffers, dictionaries."""
    body, bad = pack(GOOD_BODY), Invalid
    unsized = zstd(body, content_size=False)
    return [
        bad("binary-comp-unknown.msgpack", bdoc(comp="gzip"), DE, "bad_compression", "comp"),
        bad("binary-zstd-garbage.msgpack", bdoc(comp="zstd", raw=b"\x28\xb5\x2f\xfd garbage"),
            DE, "bad_compression", "body"),
        bad("binary-zstd-trailing.msgpack", bdoc(comp="zstd", raw=zstd(body) + b"\x00"), DE,
            "bad_compression", "body", note="a byte after the zstd frame"),
        bad("binary-zstd-two-frames.msgpack", bdoc(comp="zstd", raw=zstd(body) + zstd(b"")), DE,
            "bad_compression", "body", note="the body is exactly one frame"),
        bad("binary-zstd-unsized-trailing.msgpack", bdoc(comp="zstd", raw=unsized + zstd(b"")),
            DE, "bad_compression", "body", note="one frame, also without a content size"),
        bad("binary-zstd-truncated.msgpack", bdoc(comp="zstd", raw=unsized[:-4]), DE,
            "bad_compression", "body"),
        bad("binary-zstd-bomb.msgpack", bdoc(comp="zstd", raw=zstd(bytes(65 * 2**20))), DE,
            "decompressed_too_large", "body",
            note="65 MiB of zeros in 2 KiB; the default limit is 64 MiB"),
        bad("binary-zstd-bomb-unsized.msgpack",
            bdoc(comp="zstd", raw=zstd(bytes(2**20), content_size=False)), DE,
            "decompressed_too_large", "body", limits={"max_decompressed_bytes": 2**19}),
        bad("binary-body-not-bin.msgpack", bdoc(body="text"), SE, "bad_type", "body"),
        bad("binary-body-not-msgpack.msgpack", bdoc(raw=b"\xc1"), DE, "bad_msgpack"),
        bad("binary-missing-column.msgpack", bdoc({"value": DROP}), SE, "missing_field",
            "value"),
        bad("binary-unknown-key.msgpack", bdoc({"ts": {**GOOD_BODY["ts"], "scale": 1}}), SE,
            "unknown_field", "scale"),
        bad("binary-ts-dtype.msgpack", bdoc({"ts": {"base": T0, "dtype": "u8", "data": bytes(16)}}),
            SE, "bad_dtype", "ts.dtype"),
        bad("binary-ts-dtype-array.msgpack", bdoc({"ts": {**GOOD_BODY["ts"], "dtype": ["u1"]}}),
            SE, "bad_dtype", "ts.dtype"),
        bad("binary-value-dtype.msgpack", bdoc({"value": {"dtype": "f2", "data": bytes(4)}}), SE,
            "bad_dtype", "value.dtype"),
        bad("binary-code-dtype.msgpack", bdoc({"sensor_id": {**SID, "dtype": "i1"}}), SE,
            "bad_dtype", "sensor_id.dtype"),
        bad("binary-ts-length.msgpack",
            bdoc({"ts": {"base": T0, "dtype": "u2", "data": b"\x00\x01"}}), SE,
            "length_mismatch", "ts.data"),
        bad("binary-value-length.msgpack", bdoc({"value": {"dtype": "f8", "data": bytes(8)}}),
            SE, "length_mismatch", "value.data"),
        bad("binary-n-mismatch.msgpack", bdoc(n=3), SE, "length_mismatch", "ts.data",
            note="n says 3; the buffers hold 2"),
        bad("binary-i8-base.msgpack",
            bdoc({"ts": {"base": T0, "dtype": "i8", "data": buffer("i8", [0, 1])}}), SE,
            "out_of_range", "ts.base", note="i8 timestamps are absolute: base must be 0"),
        bad("binary-ts-overflow.msgpack",
            bdoc({"ts": {"base": MAX_TS, "dtype": "u1", "data": b"\x00\x01"}}), SE,
            "ts_in_future", "ts", 1, note="base + offset lies beyond 2^53-1"),
        bad("binary-ts-i8-negative.msgpack",
            bdoc({"ts": {"base": 0, "dtype": "i8", "data": buffer("i8", [T0, -5])}}), SE,
            "ts_in_past", "ts", 1),
        bad("binary-value-nan.msgpack",
            bdoc({"value": {"dtype": "f4", "data": buffer("f4", [1.5, math.nan])}}), SE,
            "not_finite", "value", 1),
        bad("binary-code-out-of-range.msgpack", bdoc({"sensor_id": {**SID, "codes": b"\0\2"}}),
            SE, "bad_code", "sensor_id.codes", 1),
        bad("binary-dict-not-array.msgpack", bdoc({"sensor_id": {**SID, "dict": "s1"}}), SE,
            "bad_type", "sensor_id.dict"),
        bad("binary-dict-entry-type.msgpack", bdoc({"sensor_id": {**SID, "dict": ["s1", 2]}}),
            SE, "bad_type", "sensor_id.dict[1]"),
        bad("binary-dict-nil-sensor.msgpack", bdoc({"sensor_id": {**SID, "dict": ["s1", None]}}),
            SE, "bad_type", "sensor_id.dict[1]", note="nil is for attribute dictionaries only"),
        bad("binary-dict-unused-empty.msgpack",
            bdoc({"unit": {"dict": ["°C", ""], "dtype": "u1", "codes": b"\0\0"}}), SE,
            "empty_string", "unit",
            note="every dictionary entry must be valid, even one no row uses (row is null)"),
        bad("binary-dict-too-long.msgpack",
            bdoc({"sensor_id": {**SID, "dict": ["s1", "s" * 257]}}), DE, "string_too_long",
            "sensor_id", 1),
    ]  # fmt: skip


def invalid_cases() -> list[Invalid]:
    """Every invalid case, one or more per error reason."""
    return [*framing_cases(), *rows_cases(), *columnar_cases(), *binary_cases()]
