"""MsgPack rows and MsgPack columnar batches, and the one guarded MsgPack unpacker.

Rows are maps like the JSON rows; columnar is a map of equally long arrays, one per field,
so attribute names are written once per batch instead of once per measurement.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack
import polars as pl

from shoal.errors import SchemaError
from shoal.schemas._checks import (
    check_keys,
    check_row_count,
    describe,
    read_envelope,
    require_int,
    require_map,
)
from shoal.schemas._lists import ALL_FIELDS, REQUIRED_FIELDS, frame_from_columns, frame_from_rows
from shoal.schemas._model import DecodeLimits, Envelope
from shoal.schemas._msgpack_errors import msgpack_error

MAX_MAP_KEYS: Final = 32
"""No map in the contract has more keys; larger ones are refused while unpacking."""


def unpack(data: bytes, what: str) -> Any:
    """Unpack one MsgPack object, turning every failure into a ``DecodeError``.

    The unpacker bounds every declared length by the input size, refuses maps larger than
    any the contract defines, and refuses non-string map keys and invalid UTF-8. The
    timestamp extension becomes a ``datetime``: as a ``msgpack.Timestamp`` nested in a list
    it made polars panic instead of refusing it; a ``datetime`` every check refuses cleanly.
    """
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_map_len=MAX_MAP_KEYS, timestamp=3
        )
    except Exception as exc:
        raise msgpack_error(data, exc, what) from exc


def pack(obj: Any) -> bytes:
    """Pack ``obj`` (always ``use_bin_type``, so bytes and strings stay distinct)."""
    packed = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def decode_msgpack_rows(top: dict[str, Any], limits: DecodeLimits) -> tuple[Envelope, pl.DataFrame]:
    """Decode an unpacked MsgPack rows batch."""
    envelope = read_envelope(top)
    return envelope, frame_from_rows(top["rows"], limits)


def decode_msgpack_columnar(
    top: dict[str, Any], limits: DecodeLimits
) -> tuple[Envelope, pl.DataFrame]:
    """Decode an unpacked MsgPack columnar batch."""
    envelope = read_envelope(top)
    n = require_int(top["n"], "n", 0, 2**63 - 1)
    check_row_count(n, limits, field="n")
    cols = require_map(top["cols"], "cols")
    check_keys(cols, ALL_FIELDS, REQUIRED_FIELDS, "cols")
    for name, values in cols.items():
        if not isinstance(values, list):
            raise SchemaError(
                "wrong type",
                reason="bad_type",
                field=name,
                expected="array",
                found=describe(values),
            )
    return envelope, frame_from_columns(cols, n)


def encode_msgpack_rows(header: dict[str, Any], frame: pl.DataFrame) -> bytes:
    """Encode ``frame`` (all-null attribute columns already dropped) as MsgPack rows."""
    rows = frame.to_dicts()
    for name in frame.columns:
        if frame.get_column(name).has_nulls():
            for row in rows:
                if row[name] is None:
                    del row[name]
    return pack({**header, "rows": rows})


def encode_msgpack_columnar(header: dict[str, Any], frame: pl.DataFrame) -> bytes:
    """Encode ``frame`` (all-null attribute columns already dropped) as MsgPack columnar."""
    cols = {name: frame.get_column(name).to_list() for name in frame.columns}
    return pack({**header, "n": frame.height, "cols": cols})
