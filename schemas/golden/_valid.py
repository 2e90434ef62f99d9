"""Golden payloads that must decode, with the envelope and rows they decode to."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import polars as pl
from _wire import (
    ATTRIBUTED,
    EXAMPLE,
    FRAME,
    MAX_TS,
    NUMBERS,
    PLAIN,
    T0,
    UNICODE,
    VENDOR,
    Layout,
    Row,
    binary,
    binary_body,
    decoded_envelope,
    decoded_rows,
    header,
    json_rows,
    msgpack_columnar,
    msgpack_rows,
    pack,
    row,
    wire_row,
    zstd,
)

from shoal.schemas import Encoding, encode_batch


@dataclass
class Valid:
    """A payload that decodes, and what it decodes to."""

    path: str
    payload: bytes
    content_type: str | None
    envelope: Row
    rows: list[Row]
    note: str


class ValidCases:
    """Collects valid cases; ``add`` derives the expected envelope and rows."""

    def __init__(self) -> None:
        self.cases: list[Valid] = []

    def add(  # noqa: PLR0917 - the case tables read best positionally
        self,
        path: str,
        payload: bytes,
        content_type: str | None,
        head: Row,
        rows: Sequence[Row],
        note: str,
        layout: Layout | None = None,
    ) -> None:
        """Record one case."""
        self.cases.append(
            Valid(
                path,
                payload,
                content_type,
                decoded_envelope(head, len(rows)),
                decoded_rows(rows, layout),
                note,
            )
        )


TEXT_CASES: Final = [
    ("plain", PLAIN, "four measurements, no attributes"),
    ("attributes", ATTRIBUTED, "attributes: present, explicit null and absent"),
    ("empty", [], "a batch with no measurements"),
    ("unicode", UNICODE, "non-ASCII and escaped sensor ids; a 256-byte id"),
    ("numbers", NUMBERS, "-0.0, a subnormal, extremes, integer values; ts 0 and 2^53-1"),
]


def example_cases(out: ValidCases) -> None:
    """The examples of CONTRACT.md: two rows, one unit, every encoding."""
    for enc, ext, comp in [
        ("json-rows", "json", "none"),
        ("msgpack-rows", "msgpack", "none"),
        ("msgpack-columnar", "msgpack", "none"),
        ("binary-columnar", "msgpack", "none"),
        ("binary-columnar", "msgpack", "zstd"),
    ]:
        head = header(enc, 42, sent_at=T0 + 1000)
        if enc == "json-rows":
            payload = json_rows(head, EXAMPLE)
        elif enc == "msgpack-rows":
            payload = msgpack_rows(head, EXAMPLE)
        elif enc == "msgpack-columnar":
            payload = msgpack_columnar(head, EXAMPLE)
        else:
            payload = binary(head, EXAMPLE, comp=comp)
        folder = "binary-columnar-zstd" if comp == "zstd" else enc
        out.add(f"{folder}/example.{ext}", payload, VENDOR[enc], head, EXAMPLE, "CONTRACT.md")


def rows_cases(out: ValidCases) -> None:
    """JSON rows, MsgPack rows and MsgPack columnar."""
    for i, (case, rows, note) in enumerate(TEXT_CASES):
        # Content types rotate through vendor, none and generic, so every path is exercised.
        seq = 100 + i
        head = header("json-rows", seq)
        ct = [VENDOR["json-rows"], None, "application/json"][i % 3]
        out.add(f"json-rows/{case}.json", json_rows(head, rows), ct, head, rows, note)
        head = header("msgpack-rows", seq)
        ct = [None, VENDOR["msgpack-rows"], "application/msgpack"][i % 3]
        out.add(f"msgpack-rows/{case}.msgpack", msgpack_rows(head, rows), ct, head, rows, note)
        head = header("msgpack-columnar", seq)
        ct = [VENDOR["msgpack-columnar"], "application/x-msgpack", None][i % 3]
        payload = msgpack_columnar(head, rows)
        out.add(f"msgpack-columnar/{case}.msgpack", payload, ct, head, rows, note)

    head = header("json-rows", 7, gateway_id="Site_7.gw-A")
    pretty = b"\n  " + json_rows(head, PLAIN, indent=2)
    out.add("json-rows/pretty.json", pretty, None, head, PLAIN, "leading whitespace, indented")
    reordered = {"rows": [dict(reversed(wire_row(r).items())) for r in PLAIN[::-1]], **head}
    out.add(
        "json-rows/key-order.json",
        json.dumps(reordered).encode(),
        VENDOR["json-rows"],
        head,
        PLAIN[::-1],
        "rows before the envelope keys; row keys in reverse order",
    )
    head = header("msgpack-rows", 8)
    out.add(
        "msgpack-rows/float32.msgpack",
        msgpack_rows(head, PLAIN, single_float=True),
        None,
        head,
        PLAIN,
        "values as MsgPack float 32 (all of them are exact float32 numbers)",
    )


def binary_cases(out: ValidCases) -> None:
    """Binary columnar, with and without zstd."""
    ts_u2 = [row("a", T0 + k * 300, float(k)) for k in range(4)]
    ts_u4 = [row("a", T0, 1.0), row("b", T0 + 86_400_000, 2.0), row("a", T0 + 3_600_000, 3.0)]
    ts_i8 = [row("a", T0, 1.0), row("b", T0 - 100 * 86_400_000, 2.0), row("a", MAX_TS, 3.0)]
    many = [row(f"sensor-{k:03d}", T0 + k, k / 8) for k in range(0, 300, 37)]
    spare = tuple(f"spare-{k}" for k in range(300))
    f4_rows = [row("a", T0, 0.1), row("a", T0 + 1, 21.37), row("b", T0 + 2, -1e30)]
    cases: list[tuple[str, list[Row], Layout, str]] = [
        ("plain", PLAIN, Layout(), "ts u1, codes u1, values f8"),
        ("attributes", ATTRIBUTED, Layout(ts_dtype="u2"), "attribute dictionaries with nil"),
        ("empty", [], Layout(), "no measurements: empty buffers and dictionaries"),
        ("unicode", UNICODE, Layout(), "non-ASCII sensor ids in the dictionary"),
        ("numbers", NUMBERS, Layout(ts_dtype="i8"), "edge values; ts 0 and 2^53-1"),
        ("ts-u1", PLAIN, Layout(ts_dtype="u1"), "ts offsets u1 (span 41 ms)"),
        ("ts-u2", ts_u2, Layout(ts_dtype="u2"), "ts offsets u2 (span 900 ms)"),
        ("ts-u4", ts_u4, Layout(ts_dtype="u4"), "ts offsets u4 (span one day)"),
        ("ts-i8", ts_i8, Layout(ts_dtype="i8"), "absolute ts i8 with base 0"),
        ("ts-wider", PLAIN, Layout(ts_dtype="u4"), "u4 offsets where u1 would do"),
        ("codes-u2", many, Layout("u2", code_dtype="u2", extra_entries=spare), "309 entries"),
        ("codes-u4", ATTRIBUTED, Layout("u2", code_dtype="u4"), "codes u4, wider than needed"),
        ("values-f4", f4_rows, Layout(value_dtype="f4"), "values f4, widened to float64"),
    ]
    for i, (case, rows, layout, note) in enumerate(cases):
        head = header("binary-columnar", 200 + i)
        ct = VENDOR["binary-columnar"] if i % 2 == 0 else None
        payload = binary(head, rows, layout)
        out.add(f"binary-columnar/{case}.msgpack", payload, ct, head, rows, note, layout)

    compressed = ("plain", "attributes", "empty", "unicode", "ts-i8", "values-f4")
    for i, (case, rows, layout, note) in enumerate(c for c in cases if c[0] in compressed):
        head = header("binary-columnar", 300 + i)
        ct = None if i % 2 == 0 else VENDOR["binary-columnar"]
        payload = binary(head, rows, layout, comp="zstd")
        out.add(f"binary-columnar-zstd/{case}.msgpack", payload, ct, head, rows, note, layout)
    head = header("binary-columnar", 399)
    body = zstd(binary_body(ATTRIBUTED, Layout(ts_dtype="u2")), content_size=False)
    payload = pack({**head, "n": len(ATTRIBUTED), "comp": "zstd", "body": body})
    note = "a zstd frame without a content size, as streaming compressors write"
    out.add("binary-columnar-zstd/unsized-frame.msgpack", payload, None, head, ATTRIBUTED, note)


def encoder_cases(out: ValidCases) -> None:
    """What shoal's own encoder writes for the attributes case, in every encoding."""
    schema = {
        k: pl.Int64 if k == "ts" else pl.Float64 if k == "value" else pl.String for k in FRAME
    }
    frame = pl.DataFrame([{k: r[k] for k in FRAME} for r in ATTRIBUTED], schema=schema)
    for encoding, ext, compress in [
        (Encoding.JSON_ROWS, "json", False),
        (Encoding.MSGPACK_ROWS, "msgpack", False),
        (Encoding.MSGPACK_COLUMNAR, "msgpack", False),
        (Encoding.BINARY_COLUMNAR, "msgpack", False),
        (Encoding.BINARY_COLUMNAR, "msgpack", True),
    ]:
        head = header(encoding.value, 500)
        payload = encode_batch(
            frame,
            gateway_id=head["gateway_id"],
            seq=head["seq"],
            sent_at_ms=head["sent_at"],
            encoding=encoding,
            zstd=compress,
        )
        folder = "binary-columnar-zstd" if compress else encoding.value
        path = f"{folder}/encoder.{ext}"
        ct = encoding.content_type
        out.add(path, payload, ct, head, ATTRIBUTED, "written by shoal.encode_batch")


def valid_cases() -> list[Valid]:
    """Every valid case."""
    out = ValidCases()
    example_cases(out)
    rows_cases(out)
    binary_cases(out)
    encoder_cases(out)
    return out.cases
