"""The contract's primitives, written from the prose, and the sample measurements.

MsgPack maps, typed little-endian buffers, dictionaries and zstd frames, built without shoal's
encoder so the goldens test the decoder against the contract, not against the encoder.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import zstandard

ATTRIBUTES: Final = ("name", "type", "unit")
FRAME: Final = ("sensor_id", "ts", "value", *ATTRIBUTES)
VENDOR: Final = {
    "json-rows": "application/vnd.shoal.v1.rows+json",
    "msgpack-rows": "application/vnd.shoal.v1.rows+msgpack",
    "msgpack-columnar": "application/vnd.shoal.v1.columnar+msgpack",
    "binary-columnar": "application/vnd.shoal.v1.binary+msgpack",
}
MAX_TS: Final = 2**53 - 1
T0: Final = 1_700_000_000_000  # 2023-11-14T22:13:20Z
ZSTD_LEVEL: Final = 3

Row = dict[str, Any]


def row(sensor_id: str, ts: int, value: float, **attributes: str | None) -> Row:
    """A measurement; attributes passed as None are written as explicit nulls."""
    out: Row = {"sensor_id": sensor_id, "ts": ts, "value": value}
    out |= {name: attributes.get(name) for name in ATTRIBUTES}
    out["_nulls"] = tuple(k for k, v in attributes.items() if v is None)
    return out


EXAMPLE: Final = [
    row("t1", T0, 21.5, unit="°C"),
    row("t1", T0 + 250, 21.625),
]
"""The two-row batch CONTRACT.md shows in every encoding."""

PLAIN: Final = [
    row("gw-01-s0000", T0, 21.5),
    row("gw-01-s0001", T0 + 7, 19.875),
    row("gw-01-s0000", T0 + 40, 21.625),
    row("gw-01-s0002", T0 + 41, -3.25),
]

ATTRIBUTED: Final = [
    row("boiler-1", T0, 71.25, name="Boiler flow", type="temperature", unit="°C"),
    row("boiler-1", T0 + 1000, 71.5, name="Boiler flow", type="temperature", unit="°C"),
    row("door-7", T0 + 1200, 1.0, type="contact"),
    row("pump-3", T0 + 1500, 0.75, name="Pump 3 duty", unit=None),
    row("pump-3", T0 + 2500, 0.8),
]

UNICODE: Final = [
    row("température-1", T0, 20.0),
    row("датчик-2", T0 + 1, 21.0),
    row("传感器三", T0 + 2, 22.0),
    row("🌡️-4", T0 + 3, 23.0),
    row('quote"back\\slash/tab\tnl\nnul\x00', T0 + 4, 24.0),
    row("x" * 256, T0 + 5, 25.0, unit="µS/cm"),  # exactly the default max_string_bytes
]

INTEGER_VALUES: Final = {42.0: 42, float(2**53 + 1): 2**53 + 1}
"""Values the rows encodings write as integers; 2**53 + 1 rounds (to even) to 2**53."""

NUMBERS: Final = [
    row("edge", 0, -0.0),
    row("edge", 1, 5e-324),  # smallest subnormal
    row("edge", 2, -2.2250738585072014e-308),  # smallest normal, negated
    row("edge", 3, 1.7976931348623157e308),  # largest finite
    row("edge", 4, 0.1),
    row("edge", 5, 42.0),
    row("edge", 6, float(2**53 + 1)),
    row("edge", MAX_TS, -1e-300),
]


# ---------------------------------------------------------------- encodings


def header(enc: str, seq: int, *, gateway_id: str = "gw-01", sent_at: int = T0 + 5000) -> Row:
    """The envelope keys of a batch."""
    return {"shoal": 1, "enc": enc, "gateway_id": gateway_id, "seq": seq, "sent_at": sent_at}


def wire_row(r: Row) -> Row:
    """A row map as the rows encodings carry it."""
    out = {k: r[k] for k in ("sensor_id", "ts", "value")}
    out["value"] = INTEGER_VALUES.get(r["value"], r["value"])
    for name in ATTRIBUTES:
        if r[name] is not None or name in r["_nulls"]:
            out[name] = r[name]
    return out


def json_rows(head: Row, rows: Sequence[Row], *, indent: int | None = None) -> bytes:
    """A JSON rows batch, UTF-8 (not ASCII-escaped)."""
    doc = {**head, "rows": [wire_row(r) for r in rows]}
    return json.dumps(doc, ensure_ascii=False, indent=indent, allow_nan=False).encode()


def pack(obj: Any, *, single_float: bool = False) -> bytes:
    """MsgPack with the str/bin distinction the contract requires."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True, use_single_float=single_float)
    return packed


def msgpack_rows(head: Row, rows: Sequence[Row], *, single_float: bool = False) -> bytes:
    """A MsgPack rows batch."""
    return pack({**head, "rows": [wire_row(r) for r in rows]}, single_float=single_float)


def msgpack_columnar(head: Row, rows: Sequence[Row]) -> bytes:
    """A MsgPack columnar batch; attribute columns no row carries are left out."""
    cols = {k: [r[k] for r in rows] for k in ("sensor_id", "ts", "value")}
    for name in ATTRIBUTES:
        if any(r[name] is not None for r in rows):
            cols[name] = [r[name] for r in rows]
    return pack({**head, "n": len(rows), "cols": cols})


_STRUCT_CODES: Final = {"u1": "B", "u2": "H", "u4": "I", "i8": "q", "f8": "d", "f4": "f"}


def buffer(dtype: str, values: Sequence[float]) -> bytes:
    """A little-endian typed buffer."""
    return struct.pack(f"<{len(values)}{_STRUCT_CODES[dtype]}", *values)


def dict_column(values: Sequence[str | None], code_dtype: str, extra: Sequence[str] = ()) -> Row:
    """Dictionary-code ``values`` in first-seen order; ``extra`` entries no row uses."""
    entries: list[str | None] = []
    index: dict[str | None, int] = {}
    codes = []
    for v in values:
        if v not in index:
            index[v] = len(entries)
            entries.append(v)
        codes.append(index[v])
    entries.extend(extra)
    return {"dict": entries, "dtype": code_dtype, "codes": buffer(code_dtype, codes)}


@dataclass(frozen=True)
class Layout:
    """The layout choices the contract leaves to a binary columnar writer."""

    ts_dtype: str = "u1"
    value_dtype: str = "f8"
    code_dtype: str = "u1"
    extra_entries: tuple[str, ...] = ()


DEFAULT_LAYOUT: Final = Layout()


def binary_body(rows: Sequence[Row], layout: Layout) -> bytes:
    """The MsgPack body map of a binary columnar batch."""
    ts = [r["ts"] for r in rows]
    base = 0 if layout.ts_dtype == "i8" or not ts else min(ts)
    sensor_ids = [r["sensor_id"] for r in rows]
    body: Row = {
        "sensor_id": dict_column(sensor_ids, layout.code_dtype, layout.extra_entries),
        "ts": {
            "base": base,
            "dtype": layout.ts_dtype,
            "data": buffer(layout.ts_dtype, [t - base for t in ts]),
        },
        "value": {
            "dtype": layout.value_dtype,
            "data": buffer(layout.value_dtype, [r["value"] for r in rows]),
        },
    }
    for name in ATTRIBUTES:
        if any(r[name] is not None for r in rows):
            body[name] = dict_column([r[name] for r in rows], layout.code_dtype)
    return pack(body)


def zstd(data: bytes, *, content_size: bool = True) -> bytes:
    """One zstd frame."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=content_size)
    return compressor.compress(data)


def binary(
    head: Row, rows: Sequence[Row], layout: Layout = DEFAULT_LAYOUT, *, comp: str = "none"
) -> bytes:
    """A binary columnar batch."""
    body = binary_body(rows, layout)
    if comp == "zstd":
        body = zstd(body)
    return pack({**head, "n": len(rows), "comp": comp, "body": body})


def as_f4(value: float) -> float:
    """``value`` rounded to the nearest float32, as an f4 buffer carries it."""
    result: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return result


def decoded_rows(rows: Sequence[Row], layout: Layout | None = None) -> list[Row]:
    """The rows a decoder must produce (f4 buffers carry values rounded to float32)."""
    f4 = layout is not None and layout.value_dtype == "f4"
    return [{k: as_f4(r[k]) if f4 and k == "value" else r[k] for k in FRAME} for r in rows]


def decoded_envelope(head: Row, n: int) -> Row:
    """The envelope a decoder must produce."""
    return {
        "version": head["shoal"],
        "encoding": head["enc"],
        "gateway_id": head["gateway_id"],
        "seq": head["seq"],
        "sent_at": head["sent_at"],
        "rows": n,
    }
