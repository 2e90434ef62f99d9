"""JSON rows: the research gateways' format.

Parsed with orjson (strict RFC 8259: no NaN, no invalid UTF-8, bounded depth) and turned into
columns by the same strict list checks as MsgPack rows; encoded by polars' JSON writer, which
prints floats in their shortest round-trip form.
"""

from __future__ import annotations

from typing import Any

import orjson
import polars as pl

from shoal.errors import DecodeError
from shoal.schemas._checks import read_envelope, require_map
from shoal.schemas._lists import frame_from_rows
from shoal.schemas._model import DecodeLimits, Envelope


def decode_json_rows(payload: bytes, limits: DecodeLimits) -> tuple[Envelope, pl.DataFrame]:
    """Decode a JSON rows batch into its envelope and frame."""
    try:
        top = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"invalid JSON: {exc}", reason="bad_json") from exc
    top = require_map(top, "the batch")
    envelope = read_envelope(top)
    if not envelope.encoding.is_json:
        # Refused before the body: a JSON text naming a columnar encoding has no "rows".
        raise DecodeError(
            "in-band encoding does not match the payload",
            reason="encoding_mismatch",
            field="enc",
            expected="json-rows",
            found=envelope.encoding.value,
        )
    return envelope, frame_from_rows(top["rows"], limits)


def encode_json_rows(header: dict[str, Any], frame: pl.DataFrame) -> bytes:
    """Encode ``frame`` (all-null attribute columns already dropped) as a JSON rows batch."""
    head = orjson.dumps(header)
    rows = frame.write_json().encode() if frame.height else b"[]"
    return head[:-1] + b',"rows":' + rows + b"}"
