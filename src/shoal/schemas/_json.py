"""JSON rows: the research gateways' format.

Parsed with orjson (strict RFC 8259: no NaN, no invalid UTF-8, bounded depth) and turned into
columns by the same strict list checks as MsgPack rows; encoded by polars' JSON writer, which
prints floats in their shortest round-trip form.
"""

from __future__ import annotations

import re
from typing import Any, Final

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
        raise json_error(payload, exc) from exc
    top = require_map(top, "the batch", "one JSON object ({...}) holding envelope and rows")
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


_ORJSON_CODES: Final = (
    # (fragment of orjson's message, our code, what is wrong in a device engineer's words)
    ("byte order mark", "json_byte_order_mark", "the text starts with a UTF-8 byte-order mark"),
    ("after document", "json_trailing_data", "more content follows the JSON object"),
    ("end of data", "json_truncated", "the text ends in the middle of the JSON object"),
    ("depth limit", "nesting_too_deep", "arrays/objects are nested more than 1024 deep"),
    ("recursion limit", "nesting_too_deep", "arrays/objects are nested more than 1024 deep"),
    ("number", "json_number_range", "a number beyond the range of a float64"),
    ("surrogate", "json_bad_escape", "a \\u escape that is not a Unicode character"),
    ("escape", "json_bad_escape", "an invalid escape in a string"),
)


CODES: Final = frozenset({"invalid_utf8", "json_syntax", *(code for _, code, _ in _ORJSON_CODES)})
"""Every code ``json_error`` can give (CONTRACT.md §8.1)."""


def json_error(payload: bytes, exc: orjson.JSONDecodeError) -> DecodeError:
    """The refusal, by orjson, of ``payload`` as a ``DecodeError``: code, byte offset, words."""
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as bad:
        line, column = _line_column(payload, bad.start)
        return DecodeError(
            "invalid JSON: the text is not valid UTF-8",
            reason="bad_json",
            code="invalid_utf8",
            offset=bad.start,
            line=line,
            column=column,
            expected="UTF-8 text (encode strings as UTF-8, not Latin-1 or UTF-16)",
            found=f"byte 0x{payload[bad.start]:02x} ({bad.reason})",
        )
    said = str(exc.msg)
    offset = len(str(exc.doc)[: exc.pos].encode("utf-8"))
    code, what = "json_syntax", said
    for fragment, known, words in _ORJSON_CODES:
        if fragment in said:
            code, what = known, words
            break
    wanted = re.search(r"\bexpected (.+)", said)
    expected = wanted.group(1) if wanted else "valid JSON (RFC 8259)"
    if code == "json_syntax" and payload[offset : offset + 3] in (b"NaN", b"Inf", b"-In"):
        expected = "a number (JSON has no NaN or Infinity; leave such a measurement out)"
    snippet = payload[offset : offset + 16].decode("utf-8", "replace")
    found = f"{snippet!r}" if snippet else f"the end of the payload after {len(payload)} bytes"
    if code == "json_trailing_data":
        expected = "nothing after the closing '}'"
    return DecodeError(
        f"invalid JSON: {what}",
        reason="bad_json",
        code=code,
        offset=offset,
        line=exc.lineno,
        column=exc.colno,
        expected=expected,
        found=found,
    )


def _line_column(payload: bytes, offset: int) -> tuple[int, int]:
    """1-based line and column (in bytes) of ``offset`` in ``payload``."""
    line_start = payload.rfind(b"\n", 0, offset) + 1
    return payload.count(b"\n", 0, offset) + 1, offset - line_start + 1


def encode_json_rows(header: dict[str, Any], frame: pl.DataFrame) -> bytes:
    """Encode ``frame`` (all-null attribute columns already dropped) as a JSON rows batch."""
    head = orjson.dumps(header)
    rows = frame.write_json().encode() if frame.height else b"[]"
    return head[:-1] + b',"rows":' + rows + b"}"
