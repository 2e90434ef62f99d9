"""Vectorised contract checks shared by every decoder: values, timestamps, strings, envelope.

Each check either returns normally or raises a ``SchemaError`` naming the field, the first
offending row and what was expected. No per-row Python loops.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import DecodeError, SchemaError
from shoal.schemas._model import (
    MAX_SEQ,
    MAX_TS_MS,
    MIN_TS_MS,
    SCHEMA_VERSION,
    DecodeLimits,
    Encoding,
    Envelope,
)

GATEWAY_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
"""Gateway ids are topic segments: no ``/``, ``+``, ``#``, spaces or control characters."""

ENVELOPE_KEYS: Final = frozenset({"shoal", "enc", "gateway_id", "seq", "sent_at"})

BODY_KEYS: Final = {
    Encoding.JSON_ROWS: frozenset({"rows"}),
    Encoding.MSGPACK_ROWS: frozenset({"rows"}),
    Encoding.MSGPACK_COLUMNAR: frozenset({"n", "cols"}),
    Encoding.BINARY_COLUMNAR: frozenset({"n", "comp", "body"}),
}


def describe(value: Any) -> str:
    """A short human description of a found value, for error messages."""
    kind = type(value).__name__
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, int | float):
        return f"{kind} {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes of binary"
    if isinstance(value, list):  # not tuple: a MsgPack ExtType is a namedtuple, not an array
        return f"array of {len(value)}"
    if isinstance(value, dict):
        return f"map of {len(value)} keys"
    return kind


def require_int(value: Any, field: str, low: int, high: int) -> int:
    """Return ``value`` if it is an integer (not a boolean) in ``[low, high]``."""
    if type(value) is not int:
        raise SchemaError(
            "wrong type", reason="bad_type", field=field, expected="integer", found=describe(value)
        )
    if not low <= value <= high:
        raise SchemaError(
            "out of range",
            reason="out_of_range",
            field=field,
            expected=f"integer in [{low}, {high}]",
            found=str(value),
        )
    return value


def require_map(value: Any, field: str, expected: str = "map") -> dict[Any, Any]:
    """Return ``value`` if it is a map/object (``expected``: the words for one)."""
    if not isinstance(value, dict):
        raise SchemaError(
            "wrong type", reason="bad_type", field=field, expected=expected, found=describe(value)
        )
    return value


def check_keys(
    mapping: Mapping[Any, Any],
    allowed: frozenset[str],
    required: frozenset[str],
    where: str,
    *,
    row: int | None = None,
) -> None:
    """Refuse unknown and missing keys of a map (the contract is closed)."""
    keys = set(mapping)
    unknown = sorted(map(str, keys - allowed))
    if unknown:
        raise SchemaError(
            f"unknown field in {where}",
            reason="unknown_field",
            field=unknown[0],
            row=row,
            expected=f"only {sorted(allowed)}",
            found=f"{unknown}",
        )
    missing = sorted(required - keys)
    if missing:
        raise SchemaError(
            f"missing field in {where}",
            reason="missing_field",
            field=missing[0],
            row=row,
            expected="present",
            found="absent",
        )


def read_envelope(top: Mapping[Any, Any]) -> Envelope:
    """Validate the envelope keys of a decoded top-level map.

    The returned envelope has ``rows=0``; the codec fills in the count once rows are decoded.
    """
    version = top.get("shoal")
    if version is None:
        raise DecodeError(
            "not a shoal batch: the in-band marker is missing",
            reason="not_a_batch",
            field="shoal",
            expected=f"the integer {SCHEMA_VERSION}",
            found="absent",
        )
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DecodeError(
            "unsupported wire-format version",
            reason="unsupported_version",
            field="shoal",
            expected=f"the integer {SCHEMA_VERSION}",
            found=describe(version),
        )
    enc_text = top.get("enc")
    try:
        encoding = Encoding(enc_text) if isinstance(enc_text, str) else None
    except ValueError:
        encoding = None
    if encoding is None:
        raise DecodeError(
            "unknown encoding",
            reason="unknown_encoding",
            field="enc",
            expected=" | ".join(e.value for e in Encoding),
            found=describe(enc_text),
        )
    body_keys = BODY_KEYS[encoding]
    check_keys(top, ENVELOPE_KEYS | body_keys, ENVELOPE_KEYS | body_keys, "the envelope")
    gateway_id = top["gateway_id"]
    if not isinstance(gateway_id, str) or GATEWAY_ID_PATTERN.fullmatch(gateway_id) is None:
        raise SchemaError(
            "invalid gateway id",
            reason="bad_gateway_id",
            field="gateway_id",
            expected="1-128 characters of [A-Za-z0-9_.-], starting with a letter or digit",
            found=describe(gateway_id),
        )
    seq = require_int(top["seq"], "seq", 0, MAX_SEQ)
    sent_at = require_int(top["sent_at"], "sent_at", MIN_TS_MS, MAX_TS_MS)
    return Envelope(gateway_id=gateway_id, seq=seq, sent_at_ms=sent_at, encoding=encoding, rows=0)


def check_row_count(n: int, limits: DecodeLimits, field: str = "rows") -> None:
    """Refuse batches with more rows than the limit allows."""
    if n > limits.max_rows:
        raise DecodeError(
            "too many measurements in one batch",
            reason="too_many_rows",
            field=field,
            expected=f"at most {limits.max_rows} (DecodeLimits.max_rows)",
            found=str(n),
        )


def check_values(value: npt.NDArray[np.float64]) -> None:
    """Every value must be finite (NaN and infinities are refused, not dropped)."""
    finite = np.isfinite(value)
    if finite.all():
        return
    row = int(np.argmin(finite))
    raise SchemaError(
        "value is not finite",
        reason="not_finite",
        field="value",
        row=row,
        expected="a finite float64",
        found=repr(float(value[row])),
    )


def check_timestamps(ts: npt.NDArray[np.int64], limits: DecodeLimits, now_ms: int | None) -> None:
    """Timestamps lie in the contract's range and, given a clock, within the limits.

    With ``limits.on_future == "clamp"`` timestamps beyond ``max_future_ms`` pass here (only
    the contract's range applies above); ``clamp_future`` then moves them.
    """
    if len(ts) == 0:
        return
    low, high = MIN_TS_MS, MAX_TS_MS
    low_label, high_label = f">= {MIN_TS_MS}", f"<= {MAX_TS_MS}"
    clamping = limits.on_future == "clamp"
    if now_ms is not None and limits.max_future_ms is not None and not clamping:
        high = min(high, now_ms + limits.max_future_ms)
        high_label = f"at most {limits.max_future_ms} ms after the receiver's clock ({now_ms})"
    if now_ms is not None and limits.max_past_ms is not None:
        low = max(low, now_ms - limits.max_past_ms)
        low_label = f"at most {limits.max_past_ms} ms before the receiver's clock ({now_ms})"
    if int(ts.max()) > high:
        row = int(np.argmax(ts > high))
        raise SchemaError(
            "timestamp too far in the future",
            reason="ts_in_future",
            field="ts",
            row=row,
            expected=high_label,
            found=str(int(ts[row])),
        )
    if int(ts.min()) < low:
        row = int(np.argmax(ts < low))
        raise SchemaError(
            "timestamp too far in the past",
            reason="ts_in_past",
            field="ts",
            row=row,
            expected=low_label,
            found=str(int(ts[row])),
        )


def clamp_future(
    ts: npt.NDArray[np.int64], limits: DecodeLimits, now_ms: int | None, sent_at_ms: int
) -> tuple[npt.NDArray[np.int64], int]:
    """Timestamps beyond ``max_future_ms`` set to a reference time; (new array, how many).

    Only with ``limits.on_future == "clamp"`` and a clock; otherwise ``ts`` comes back as it
    is. The reference is the batch's own ``sent_at`` (the gateway's clock when it sealed the
    batch) when that lies within the limits itself: it is in the payload, so every worker
    and every re-send clamps the batch alike. A gateway whose own clock runs ahead has a
    ``sent_at`` beyond the limit too; then the receiver's clock is the only reference left,
    and which window a clamped row lands in depends on when it was processed (see
    docs/guarantees.md, "Far-future input"). The returned array is new; ``ts`` is untouched.
    """
    if limits.on_future != "clamp" or now_ms is None or limits.max_future_ms is None:
        return ts, 0
    limit = now_ms + limits.max_future_ms
    beyond = ts > limit
    clamped = int(np.count_nonzero(beyond))
    if clamped == 0:
        return ts, 0
    floor = MIN_TS_MS if limits.max_past_ms is None else now_ms - limits.max_past_ms
    reference = sent_at_ms if floor <= sent_at_ms <= limit else now_ms
    return np.where(beyond, np.int64(reference), ts), clamped


def check_strings(
    strings: pl.Series,
    field: str,
    limits: DecodeLimits,
    *,
    nullable: bool,
    row_of: Callable[[int], int | None] = int,
) -> None:
    """Strings are non-empty and within the length limit; nulls only where allowed.

    ``strings`` may be a dictionary rather than a column; ``row_of`` maps an index in it to
    the first row that uses it (None for an entry no row uses).
    """
    if not nullable and strings.null_count():
        index = int(strings.is_null().arg_true()[0])
        raise SchemaError(
            "missing value",
            reason="null_value",
            field=field,
            row=row_of(index),
            expected="a non-empty string",
            found="null",
        )
    lengths = strings.str.len_bytes()
    if strings.null_count():
        lengths = lengths.fill_null(1)  # nulls were allowed above; give them a passing length
    if lengths.len() == 0:
        return
    longest, shortest = lengths.max(), lengths.min()
    assert isinstance(longest, int)
    assert isinstance(shortest, int)
    if longest > limits.max_string_bytes:
        index = int(np.argmax(lengths.to_numpy() > limits.max_string_bytes))
        raise DecodeError(
            "string too long",
            reason="string_too_long",
            field=field,
            row=row_of(index),
            expected=f"at most {limits.max_string_bytes} UTF-8 bytes (limit max_string_bytes)",
            found=f"{int(lengths[index])} bytes",
        )
    if shortest == 0:
        index = int(np.argmax(lengths.to_numpy() == 0))
        raise SchemaError(
            "empty string",
            reason="empty_string",
            field=field,
            row=row_of(index),
            expected="a non-empty string",
            found="''",
        )
