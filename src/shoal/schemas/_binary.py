"""Binary columnar: typed little-endian buffers in MsgPack, dictionary-coded strings, optional zstd.

Layout (normative text in ``schemas/CONTRACT.md``)::

    envelope + {"n": rows, "comp": "none" | "zstd", "body": bin}
    body = MsgPack map {
      "ts":        {"base": int, "dtype": "u1"|"u2"|"u4"|"i8", "data": bin},   ts = base + data
      "value":     {"dtype": "f8"|"f4", "data": bin},
      "sensor_id": {"dict": [str, ...], "dtype": "u1"|"u2"|"u4", "codes": bin},
      "name"|"type"|"unit" (optional): {"dict": [str | nil, ...], "dtype": ..., "codes": bin},
    }

Decoding views the buffers with numpy and hands them to polars: no per-row Python objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl
import zstandard

from shoal.errors import DecodeError, SchemaError
from shoal.schemas._checks import (
    check_keys,
    check_row_count,
    check_strings,
    describe,
    read_envelope,
    require_int,
    require_map,
)
from shoal.schemas._lists import ALL_FIELDS, REQUIRED_FIELDS
from shoal.schemas._model import (
    ATTRIBUTE_COLUMNS,
    FRAME_SCHEMA,
    MAX_TS_MS,
    DecodeLimits,
    DictColumn,
    Envelope,
    FrameBuilder,
    Measurements,
    null_strings,
)
from shoal.schemas._msgpack import pack, unpack

_TS_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "u1": np.dtype("<u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
    "i8": np.dtype("<i8"),
}
_VALUE_DTYPES: Final[dict[str, np.dtype[Any]]] = {"f8": np.dtype("<f8"), "f4": np.dtype("<f4")}
_CODE_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "u1": np.dtype("<u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
}
_COMPRESSIONS: Final = ("none", "zstd")
ZSTD_LEVEL: Final = 3
_FEED_BYTES: Final = 256

_decompressor = zstandard.ZstdDecompressor()


def decode_binary(top: dict[str, Any], limits: DecodeLimits) -> DecodedBinary:
    """Decode an unpacked binary columnar batch into arrays, codes and a frame on demand."""
    envelope = read_envelope(top)
    n = require_int(top["n"], "n", 0, 2**63 - 1)
    check_row_count(n, limits, field="n")
    comp = top["comp"]
    if comp not in _COMPRESSIONS:
        raise DecodeError(
            "unknown compression",
            reason="bad_compression",
            field="comp",
            expected=" | ".join(_COMPRESSIONS),
            found=describe(comp),
        )
    raw = top["body"]
    if not isinstance(raw, bytes):
        raise SchemaError(
            "wrong type", reason="bad_type", field="body", expected="bin", found=describe(raw)
        )
    if comp == "zstd":
        raw = _inflate(raw, limits)
    body = require_map(unpack(raw, "the body"), "body")
    check_keys(body, ALL_FIELDS, REQUIRED_FIELDS, "body")
    ts = _timestamps(require_map(body["ts"], "ts"), n)
    value = _values(require_map(body["value"], "value"), n)
    strings = {
        "sensor_id": _strings(
            require_map(body["sensor_id"], "sensor_id"), "sensor_id", n, limits, nullable=False
        )
    }
    for name in ATTRIBUTE_COLUMNS:
        spec = body.get(name)
        if spec is not None:
            strings[name] = _strings(require_map(spec, name), name, n, limits, nullable=True)

    def column(name: str) -> pl.Series:
        if name not in strings:
            return null_strings(name, n)
        dictionary, coded = strings[name]
        return dictionary.gather(pl.Series(coded.codes, dtype=pl.UInt32)).alias(name)

    def frame(columns: Collection[str] | None = None) -> pl.DataFrame:
        wanted = FRAME_SCHEMA.names() if columns is None else columns
        built = {
            "ts": lambda: pl.Series("ts", ts),
            "value": lambda: pl.Series("value", value),
        }
        return pl.DataFrame(
            [
                built[name]() if name in built else column(name)
                for name in FRAME_SCHEMA.names()
                if name in wanted
            ]
        )

    codes = {name: coded for name, (_, coded) in strings.items()}
    return DecodedBinary(envelope, frame, codes, ts, value)


@dataclass(frozen=True, slots=True)
class DecodedBinary:
    """What ``decode_binary`` found: checked arrays and codes, and the frame on demand."""

    envelope: Envelope
    frame: FrameBuilder
    codes: dict[str, DictColumn]
    ts: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]


def encode_binary(header: dict[str, Any], block: Measurements, *, zstd: bool) -> bytes:
    """Encode a block of measurements as a binary columnar batch."""
    n = len(block)
    ts = np.ascontiguousarray(block.ts, dtype=np.int64)
    body: dict[str, Any] = {
        "ts": _pack_ts(ts),
        "value": {"dtype": "f8", "data": np.ascontiguousarray(block.value, dtype="<f8").tobytes()},
        "sensor_id": _pack_dict(block.sensor_id),
    }
    for name, col in block.attributes.items():
        body[name] = _pack_dict(col)
    raw = pack(body)
    if zstd:
        raw = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    return pack({**header, "n": n, "comp": "zstd" if zstd else "none", "body": raw})


def _pack_ts(ts: npt.NDArray[np.int64]) -> dict[str, Any]:
    if len(ts) == 0:
        return {"base": 0, "dtype": "u1", "data": b""}
    base = int(ts.min())
    span = int(ts.max()) - base
    for name in ("u1", "u2", "u4"):
        if span <= np.iinfo(_TS_DTYPES[name]).max:
            offsets = (ts - base).astype(_TS_DTYPES[name])
            return {"base": base, "dtype": name, "data": offsets.tobytes()}
    return {"base": 0, "dtype": "i8", "data": ts.astype("<i8").tobytes()}


def _pack_dict(col: DictColumn) -> dict[str, Any]:
    # Ship only the entries this block uses, renumbered densely, so the dictionary of a
    # gateway with many sensors does not ride along on every small batch.
    codes: npt.NDArray[np.integer[Any]] = col.codes
    size = len(col.values)
    used = np.bincount(codes, minlength=size) > 0 if len(codes) else np.zeros(size, dtype=bool)
    if used.all():
        values: list[str | None] = list(col.values)
    else:
        remap = np.cumsum(used, dtype=np.int64) - 1
        codes = remap[codes]
        values = [v for v, u in zip(col.values, used.tolist(), strict=True) if u]
    width = "u1" if len(values) <= 2**8 else "u2" if len(values) <= 2**16 else "u4"
    return {"dict": values, "dtype": width, "codes": codes.astype(_CODE_DTYPES[width]).tobytes()}


def _inflate(data: bytes, limits: DecodeLimits) -> bytes:
    cap = limits.max_decompressed_bytes
    try:
        declared = zstandard.frame_content_size(data)
        if declared > cap:
            raise _too_big(cap, f"{declared} bytes declared")
        if declared >= 0:
            # Exactly one frame: bytes after it (garbage, a second frame) are refused, since a
            # decoder that reads across frames would see a different body.
            return _decompressor.decompress(data, allow_extra_data=False)
        return _inflate_unsized(data, cap)
    except zstandard.ZstdError as exc:
        raise DecodeError(
            f"invalid zstd body: {exc}", reason="bad_compression", field="body"
        ) from exc


def _inflate_unsized(data: bytes, cap: int) -> bytes:
    # No size in the frame header. Feed small slices so output beyond the cap is noticed
    # early (one 4-byte RLE block inflates to 128 KiB), and insist on one complete frame.
    inflater = _decompressor.decompressobj()
    chunks, total = [], 0
    for start in range(0, len(data), _FEED_BYTES):
        chunk = inflater.decompress(data[start : start + _FEED_BYTES])
        chunks.append(chunk)
        total += len(chunk)
        if total > cap:
            raise _too_big(cap, "more")
        if inflater.eof:
            if inflater.unused_data or start + _FEED_BYTES < len(data):
                raise DecodeError(
                    "bytes after the zstd frame", reason="bad_compression", field="body"
                )
            return b"".join(chunks)
    raise DecodeError("truncated zstd frame", reason="bad_compression", field="body")


def _too_big(cap: int, found: str) -> DecodeError:
    return DecodeError(
        "compressed body inflates beyond the limit",
        reason="decompressed_too_large",
        field="body",
        expected=f"at most {cap} bytes (DecodeLimits.max_decompressed_bytes)",
        found=found,
    )


def _buffer(
    spec: dict[str, Any], field: str, key: str, dtypes: dict[str, np.dtype[Any]], n: int
) -> npt.NDArray[Any]:
    name = spec.get("dtype")
    if not isinstance(name, str) or name not in dtypes:  # a list or map is not hashable
        raise SchemaError(
            "unknown buffer type",
            reason="bad_dtype",
            field=f"{field}.dtype",
            expected=" | ".join(dtypes),
            found=describe(name),
        )
    data = spec.get(key)
    if not isinstance(data, bytes):
        raise SchemaError(
            "wrong type",
            reason="bad_type",
            field=f"{field}.{key}",
            expected="bin",
            found=describe(data),
        )
    dtype = dtypes[name]
    if len(data) != n * dtype.itemsize:
        raise SchemaError(
            "buffer length does not match the row count",
            reason="length_mismatch",
            field=f"{field}.{key}",
            expected=f"{n} x {dtype.itemsize} = {n * dtype.itemsize} bytes",
            found=f"{len(data)} bytes",
        )
    return np.frombuffer(data, dtype=dtype)


def _timestamps(spec: dict[str, Any], n: int) -> npt.NDArray[np.int64]:
    check_keys(
        spec, frozenset({"base", "dtype", "data"}), frozenset({"base", "dtype", "data"}), "ts"
    )
    offsets = _buffer(spec, "ts", "data", _TS_DTYPES, n)
    if spec["dtype"] == "i8":
        require_int(spec["base"], "ts.base", 0, 0)
        return offsets.astype(np.int64, copy=False)
    base = require_int(spec["base"], "ts.base", 0, MAX_TS_MS)
    # base <= 2**53 and offsets < 2**32: the sum cannot overflow int64.
    return offsets.astype(np.int64) + base


def _values(spec: dict[str, Any], n: int) -> npt.NDArray[np.float64]:
    check_keys(spec, frozenset({"dtype", "data"}), frozenset({"dtype", "data"}), "value")
    raw = _buffer(spec, "value", "data", _VALUE_DTYPES, n)
    # Widening a signalling NaN from f4 warns (an error under -W error); it is refused as
    # not_finite right after, so the warning adds nothing.
    with np.errstate(invalid="ignore"):
        return raw.astype(np.float64, copy=False)


def _strings(
    spec: dict[str, Any], field: str, n: int, limits: DecodeLimits, *, nullable: bool
) -> tuple[pl.Series, DictColumn]:
    """A dictionary-coded column: its checked dictionary (a Series) and the row codes."""
    keys = frozenset({"dict", "dtype", "codes"})
    check_keys(spec, keys, keys, field)
    entries = spec["dict"]
    if not isinstance(entries, list):
        raise SchemaError(
            "wrong type",
            reason="bad_type",
            field=f"{field}.dict",
            expected="array",
            found=describe(entries),
        )
    codes = _buffer(spec, field, "codes", _CODE_DTYPES, n)
    if n and int(codes.max()) >= len(entries):
        row = int(np.argmax(codes >= len(entries)))
        raise SchemaError(
            "dictionary code out of range",
            reason="bad_code",
            field=f"{field}.codes",
            row=row,
            expected=f"< {len(entries)} (the dictionary size)",
            found=str(int(codes[row])),
        )
    # A dictionary seen before (equal entries, so strings or nils only) was checked then.
    dictionary = _DICTIONARIES.get(field, entries, limits.max_string_bytes, nullable=nullable)
    if dictionary is None:
        _check_entry_types(field, entries, nullable=nullable)  # also makes them hashable
        dictionary = _checked_dictionary(field, entries, codes, limits, nullable=nullable)
        _DICTIONARIES.put(field, entries, limits.max_string_bytes, dictionary, nullable=nullable)
    return dictionary, DictColumn(tuple(entries), codes.astype(np.uint32, copy=False))


def _checked_dictionary(
    field: str,
    entries: list[Any],
    codes: npt.NDArray[Any],
    limits: DecodeLimits,
    *,
    nullable: bool,
) -> pl.Series:
    dictionary = pl.Series(field, entries, dtype=pl.String)

    def first_row(index: int) -> int | None:
        hits = np.flatnonzero(codes == index)
        return int(hits[0]) if len(hits) else None

    # Every entry must be valid, even one no row uses: the dictionary is part of the contract.
    check_strings(dictionary, field, limits, nullable=nullable, row_of=first_row)
    return dictionary


def _check_entry_types(field: str, entries: list[Any], *, nullable: bool) -> None:
    allowed = (str, type(None)) if nullable else (str,)
    if not set(map(type, entries)) <= set(allowed):
        index = next(i for i, e in enumerate(entries) if type(e) not in allowed)
        raise SchemaError(
            "wrong type in dictionary",
            reason="bad_type",
            field=f"{field}.dict[{index}]",
            expected="string or nil" if nullable else "string",
            found=describe(entries[index]),
        )


class _DictionaryCache:
    """Dictionaries already checked, by content: gateways send the same one batch after batch.

    Pure memoisation of ``_checked_dictionary`` (only dictionaries that passed are kept), so
    a hit saves building and checking a series of a thousand strings per batch. A hit on the
    newest entry (one gateway's dictionary, batch after batch) is compared with it directly,
    not hashed, and not moved to the end: that hashed and compared the thousand strings a
    second time (~14 us).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[_CacheKey, tuple[_CacheKey, pl.Series]] = OrderedDict()
        self._newest: _CacheKey | None = None  # the key object at the end of ``_items``

    def get(
        self, field: str, entries: list[Any], max_bytes: int, *, nullable: bool
    ) -> pl.Series | None:
        key = (field, tuple(entries), max_bytes, nullable)
        newest = self._newest
        if newest is not None and key == newest:  # no hash of the thousand strings (~9 us)
            return self._items[newest][1]
        try:
            found = self._items.get(key)
        except TypeError:  # an unhashable entry: not a dictionary we checked
            return None
        if found is None:
            return None
        stored, series = found
        if stored is not self._newest:
            self._items.move_to_end(stored)
            self._newest = stored
        return series

    def put(
        self, field: str, entries: list[Any], max_bytes: int, series: pl.Series, *, nullable: bool
    ) -> None:
        key = (field, tuple(entries), max_bytes, nullable)
        self._items[key] = (key, series)
        self._items.move_to_end(key)
        self._newest = key
        while len(self._items) > self.size:
            self._items.popitem(last=False)


_CacheKey = tuple[str, tuple[Any, ...], int, bool]
"""A checked dictionary's field, entries, string limit and whether it may hold nils."""

_DICTIONARIES: Final = _DictionaryCache(64)
