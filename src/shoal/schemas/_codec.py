"""Encode and decode batches: encoding detection, dispatch, and the checks every batch passes.

``decode_batch`` is total: for any byte string it returns a ``Batch`` whose frame has exactly
``FRAME_SCHEMA`` or raises ``DecodeError``/``SchemaError``; nothing else escapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson
import polars as pl

from shoal.errors import ConfigError, DecodeError, InputError, SchemaError
from shoal.schemas._binary import DecodedBinary, decode_binary, encode_binary
from shoal.schemas._checks import (
    GATEWAY_ID_PATTERN,
    check_strings,
    check_timestamps,
    check_values,
    clamp_future,
    describe,
    require_map,
)
from shoal.schemas._detect import detect_syntax
from shoal.schemas._json import decode_json_rows, encode_json_rows
from shoal.schemas._model import (
    ATTRIBUTE_COLUMNS,
    CONTENT_TYPE_TO_ENCODING,
    GENERIC_JSON_TYPES,
    GENERIC_MSGPACK_TYPES,
    MAX_SEQ,
    SCHEMA_VERSION,
    Batch,
    DecodeLimits,
    Encoding,
    FrameBuilder,
    Measurements,
)
from shoal.schemas._msgpack import (
    decode_msgpack_columnar,
    decode_msgpack_rows,
    encode_msgpack_columnar,
    encode_msgpack_rows,
    unpack,
)

DEFAULT_LIMITS: Final = DecodeLimits()


def declared_encoding(content_type: str | None) -> Encoding | None:
    """The encoding an MQTT 5 content type names; None when absent or generic JSON/MsgPack.

    Raises:
        DecodeError: the content type names something that is not a shoal batch.
    """
    if not content_type:
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    if media in CONTENT_TYPE_TO_ENCODING:
        return CONTENT_TYPE_TO_ENCODING[media]
    if media in GENERIC_JSON_TYPES or media in GENERIC_MSGPACK_TYPES:
        return None
    raise DecodeError(
        "unsupported content type",
        reason="bad_content_type",
        field="content-type",
        expected=" | ".join(sorted(CONTENT_TYPE_TO_ENCODING)),
        found=repr(content_type),
    )


def decode_batch(
    payload: bytes,
    *,
    content_type: str | None = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
    now_ms: int | None = None,
    payload_format: int | None = None,
) -> Batch:
    """Decode one batch payload.

    Args:
        payload: the MQTT payload.
        content_type: the MQTT 5 content type, if the publisher set one. Without it the
            in-band marker decides (MQTT 3.1.1 publishers).
        limits: bounds on size, rows, strings and timestamps.
        now_ms: the receiver's clock, for the timestamp limits (None: no clock checks).
        payload_format: the MQTT 5 payload format indicator (1: UTF-8 text), if set; with
            the content type it decides the syntax of a payload whose first byte does not.

    Every refusal after the syntax is chosen names it and why (``InputError.format`` and
    ``assumed``: "read as JSON because it starts with '{'").

    Raises:
        DecodeError: the bytes are not a readable batch, or exceed a limit.
        SchemaError: a readable batch that breaks the contract.
    """
    if len(payload) > limits.max_payload_bytes:
        raise DecodeError(
            "payload too large",
            reason="payload_too_large",
            expected=f"at most {limits.max_payload_bytes} bytes (DecodeLimits.max_payload_bytes)",
            found=f"{len(payload)} bytes",
        )
    if not payload:
        raise DecodeError(
            "empty payload", reason="empty_payload", expected="a batch", found="0 bytes"
        )
    declared = declared_encoding(content_type)
    payload = bytes(payload)
    detected = detect_syntax(
        payload, content_type=content_type, declared=declared, payload_format=payload_format
    )
    try:
        is_json = detected.syntax == "JSON"
        return _decode(payload, is_json=is_json, declared=declared, limits=limits, now_ms=now_ms)
    except InputError as exc:
        if exc.format is None:
            exc.format, exc.assumed = detected.syntax, detected.because
        raise


def _decode(
    payload: bytes,
    *,
    is_json: bool,
    declared: Encoding | None,
    limits: DecodeLimits,
    now_ms: int | None,
) -> Batch:
    """``decode_batch`` once the syntax is chosen."""
    binary: DecodedBinary | None = None
    if is_json:
        envelope, frame = decode_json_rows(payload, limits)
    else:
        top = require_map(unpack(payload, "the batch"), "the batch")
        enc = top.get("enc")
        if enc == Encoding.BINARY_COLUMNAR.value:
            binary = decode_binary(top, limits)
            envelope = binary.envelope
        else:
            decoder = (
                _MSGPACK_DECODERS.get(enc, decode_msgpack_rows)
                if isinstance(enc, str)
                else decode_msgpack_rows
            )
            envelope, frame = decoder(top, limits)
    if envelope.encoding.is_json != is_json:
        raise DecodeError(
            "in-band encoding does not match the payload",
            reason="encoding_mismatch",
            field="enc",
            expected="json-rows" if is_json else "a MsgPack encoding",
            found=envelope.encoding.value,
        )
    if declared is not None and declared is not envelope.encoding:
        raise SchemaError(
            "content type and in-band encoding disagree",
            reason="encoding_mismatch",
            field="enc",
            expected=f"{declared.value} (from the content type)",
            found=envelope.encoding.value,
        )
    if binary is not None:
        # Strings were checked on their dictionaries; the frame is built only if asked for.
        check_values(binary.value)
        check_timestamps(binary.ts, limits, now_ms)
        envelope = dataclasses.replace(envelope, rows=len(binary.ts))
        ts, clamped = clamp_future(binary.ts, limits, now_ms, envelope.sent_at_ms)
        build = binary.frame if not clamped else _with_ts(binary.frame, ts)
        return Batch(envelope, build, binary.codes, ts=ts, value=binary.value, clamped=clamped)
    _check_frame(frame, limits, now_ms)
    ts, clamped = clamp_future(
        frame.get_column("ts").to_numpy(), limits, now_ms, envelope.sent_at_ms
    )
    if clamped:
        frame = frame.with_columns(pl.Series("ts", ts, dtype=pl.Int64))
    return Batch(dataclasses.replace(envelope, rows=frame.height), frame, clamped=clamped)


def _with_ts(build: FrameBuilder, ts: npt.NDArray[np.int64]) -> FrameBuilder:
    """A frame builder whose ``ts`` column is ``ts`` (clamped timestamps, built on demand)."""

    def clamped(columns: Collection[str] | None) -> pl.DataFrame:
        frame = build(columns)
        if "ts" not in frame.columns:
            return frame
        return frame.with_columns(pl.Series("ts", ts, dtype=pl.Int64))

    return clamped


def peek_envelope(payload: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> tuple[str, int] | None:
    """(gateway_id, seq) of a payload whose rows may be bad, if its envelope is readable.

    Lets a worker mark a refused batch as handled for its gateway's sequence; returns None
    when the payload is too large, unreadable, or its gateway id or seq is invalid.
    """
    if not payload or len(payload) > limits.max_payload_bytes:
        return None
    try:
        if payload[:1] in (b"{", b" ", b"\t", b"\r", b"\n"):
            top = orjson.loads(payload)
        else:
            top = unpack(bytes(payload), "the batch")
    except (DecodeError, ValueError):
        return None
    if not isinstance(top, dict):
        return None
    gateway_id, seq = top.get("gateway_id"), top.get("seq")
    if not isinstance(gateway_id, str) or GATEWAY_ID_PATTERN.fullmatch(gateway_id) is None:
        return None
    if type(seq) is not int or not 0 <= seq <= MAX_SEQ:
        return None
    return gateway_id, seq


def encode_batch(
    block: Measurements | pl.DataFrame,
    *,
    gateway_id: str,
    seq: int,
    sent_at_ms: int,
    encoding: Encoding,
    zstd: bool = False,
) -> bytes:
    """Encode measurements as one batch payload in the given encoding.

    ``block`` is a ``Measurements`` block (fast for producers holding arrays) or a DataFrame
    with at least ``sensor_id``, ``ts`` and ``value``. ``zstd`` applies to binary columnar only.
    """
    if GATEWAY_ID_PATTERN.fullmatch(gateway_id) is None:
        raise SchemaError(
            "invalid gateway id",
            reason="bad_gateway_id",
            field="gateway_id",
            expected="1-128 characters of [A-Za-z0-9_.-], starting with a letter or digit",
            found=describe(gateway_id),
        )
    if not 0 <= seq <= MAX_SEQ:
        raise SchemaError("seq out of range", reason="out_of_range", field="seq", found=str(seq))
    if zstd and encoding is not Encoding.BINARY_COLUMNAR:
        raise ConfigError(
            f"zstd applies to the binary-columnar encoding only, not {encoding.value}"
        )
    header: dict[str, Any] = {
        "shoal": SCHEMA_VERSION,
        "enc": encoding.value,
        "gateway_id": gateway_id,
        "seq": seq,
        "sent_at": sent_at_ms,
    }
    if encoding is Encoding.BINARY_COLUMNAR:
        measurements = block if isinstance(block, Measurements) else Measurements.from_frame(block)
        return encode_binary(header, measurements, zstd=zstd)
    frame = block.to_frame() if isinstance(block, Measurements) else block
    frame = frame.select(
        name
        for name in frame.columns
        if name in ("sensor_id", "ts", "value")
        or (name in ATTRIBUTE_COLUMNS and frame.get_column(name).null_count() < frame.height)
    )
    if encoding is Encoding.JSON_ROWS:
        return encode_json_rows(header, frame)
    if encoding is Encoding.MSGPACK_ROWS:
        return encode_msgpack_rows(header, frame)
    return encode_msgpack_columnar(header, frame)


_MSGPACK_DECODERS: Final = {
    Encoding.MSGPACK_ROWS.value: decode_msgpack_rows,
    Encoding.MSGPACK_COLUMNAR.value: decode_msgpack_columnar,
}


def _check_frame(frame: pl.DataFrame, limits: DecodeLimits, now_ms: int | None) -> None:
    check_values(frame.get_column("value").to_numpy())
    check_timestamps(frame.get_column("ts").to_numpy(), limits, now_ms)
    check_strings(frame.get_column("sensor_id"), "sensor_id", limits, nullable=False)
    for name in ATTRIBUTE_COLUMNS:
        column = frame.get_column(name)
        if column.null_count() < column.len():
            check_strings(column, name, limits, nullable=True)
