"""msgpack's exceptions turned into refusals a device engineer can act on.

msgpack says "unpack(b) received extra data.", an empty ``StackError`` or a position inside
one string; this module says what was expected, what was found, and where (byte offset, and
the field and row for a string that is not UTF-8). Imported only by ``_msgpack``.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgpack

from shoal.errors import DecodeError
from shoal.schemas._checks import describe

_MAP_KEY: Final = re.compile(r"^([\w.]+) is not allowed for map key")
_MAP_LEN: Final = re.compile(r"^(\d+) exceeds max_map_len\((\d+)\)")
_OTHER_LEN: Final = re.compile(r"^(\d+) exceeds max_(array|str|bin|ext)_len\((\d+)\)")
_KINDS: Final = {
    "array": "an array",
    "str": "a string",
    "bin": "binary data",
    "ext": "an extension",
}
CODES: Final = frozenset(
    {
        "msgpack_extra_data",
        "nesting_too_deep",
        "msgpack_reserved_byte",
        "invalid_utf8",
        "msgpack_truncated",
        "msgpack_map_key",
        "msgpack_map_too_large",
        "msgpack_bad_length",
        "msgpack_bad_extension",
        "msgpack_invalid",
    }
)
"""Every code ``msgpack_error`` can give (CONTRACT.md §8.1)."""
_MAX_DEPTH: Final = 1024
"""msgpack's C unpacker's nesting limit (its compiled-in stack)."""


def msgpack_error(data: bytes, exc: Exception, what: str) -> DecodeError:
    """``exc``, raised unpacking ``data`` (``what``: "the batch", "the body"), in words."""

    def refuse(words: str, code: str, **detail: Any) -> DecodeError:
        return DecodeError(
            f"invalid MsgPack in {what}: {words}", reason="bad_msgpack", code=code, **detail
        )

    if isinstance(exc, msgpack.ExtraData):
        # The stubs do not know ExtraData's attributes (the first value and the rest).
        unpacked, extra = getattr(exc, "unpacked", None), bytes(getattr(exc, "extra", b""))
        end = len(data) - len(extra)
        return refuse(
            f"one complete value ends at byte {end}, but {len(extra)} more bytes follow",
            "msgpack_extra_data",
            offset=end,
            expected="exactly one MsgPack map" if what == "the batch" else "exactly one value",
            found=f"{describe(unpacked)}, then more bytes",
        )
    if isinstance(exc, msgpack.StackError):
        return refuse(
            f"arrays/maps are nested more than {_MAX_DEPTH} deep",
            "nesting_too_deep",
            expected="a batch (maps and arrays at most 4 levels deep)",
            found=f"more than {_MAX_DEPTH} levels",
        )
    if isinstance(exc, msgpack.FormatError):
        return refuse(
            "a byte that starts no MsgPack value",
            "msgpack_reserved_byte",
            expected="a MsgPack value",
            found="the reserved byte 0xc1",
        )
    if isinstance(exc, UnicodeDecodeError):
        return _invalid_utf8(data, exc, refuse)
    said = str(exc)
    if "incomplete input" in said or isinstance(exc, msgpack.OutOfData):
        return refuse(
            f"the data ends after {len(data)} bytes, in the middle of a value",
            "msgpack_truncated",
            offset=len(data),
            expected="the rest of the value (was the payload cut short?)",
            found="the end of the payload",
        )
    if match := _MAP_KEY.match(said):
        return refuse(
            "a map key that is not a string",
            "msgpack_map_key",
            expected="string keys (str)",
            found=f"a key of type {match.group(1)}",
        )
    if match := _MAP_LEN.match(said):
        return refuse(
            "a map with more entries than any map in a batch has",
            "msgpack_map_too_large",
            expected=f"at most {match.group(2)} entries",
            found=f"{match.group(1)} entries",
        )
    if match := _OTHER_LEN.match(said):
        # msgpack bounds every declared length by the payload's size: this one cannot fit.
        return refuse(
            f"{_KINDS[match.group(2)]} declares a length the rest of the payload cannot hold",
            "msgpack_bad_length",
            expected=f"at most {match.group(3)} (what the {len(data)}-byte payload could hold)",
            found=f"a declared length of {match.group(1)}",
        )
    if "code must be" in said:
        return refuse(
            "an extension type code outside 0..127 (only -1, the timestamp, is predefined)",
            "msgpack_bad_extension",
            expected="no extension types in a batch",
            found="an extension with a reserved negative type code",
        )
    if "nanoseconds" in said:  # msgpack.Timestamp: a 12-byte timestamp's nanoseconds field
        return refuse(
            "a timestamp extension (type -1) whose nanoseconds are out of range",
            "msgpack_bad_extension",
            expected="nanoseconds in 0..999999999 (better: no timestamp extension at all)",
            found=said,
        )
    if "timestamp" in said:
        return refuse(
            "a timestamp extension (type -1) of the wrong length",
            "msgpack_bad_extension",
            expected="4, 8 or 12 bytes of timestamp data",
            found=said,
        )
    return refuse(said or type(exc).__name__, "msgpack_invalid", found=type(exc).__name__)


def _invalid_utf8(data: bytes, exc: UnicodeDecodeError, refuse: Any) -> DecodeError:
    """A str that is not UTF-8: found again in a raw unpack, to name its field, row and byte."""
    bad = bytes(exc.object)
    path: list[str | int] = []
    try:
        raw = msgpack.unpackb(data, raw=True, strict_map_key=False, timestamp=3)
        path = _path_to(raw, bad) or []
    except Exception:  # noqa: BLE001 - the first error is the one reported
        path = []
    start = data.find(bad)
    field, row = _field_row(path)
    error: DecodeError = refuse(
        "a string that is not valid UTF-8",
        "invalid_utf8",
        field=field,
        row=row,
        offset=start + exc.start if start >= 0 else None,
        expected="UTF-8 text (encode strings as UTF-8, not Latin-1; bytes go in bin, not str)",
        found=f"byte 0x{bad[exc.start]:02x} ({exc.reason})",
    )
    return error


def _path_to(value: Any, bad: bytes) -> list[str | int] | None:
    """The keys and indexes leading to the raw string ``bad`` (a key or a value)."""
    if isinstance(value, bytes):
        return [] if value == bad else None
    items: list[tuple[str | int, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            name = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
            if key == bad:
                return [name]
            items.append((name, item))
    elif isinstance(value, list):
        items = list(enumerate(value))
    for step, item in items:
        rest = _path_to(item, bad)
        if rest is not None:
            return [step, *rest]
    return None


def _field_row(path: list[str | int]) -> tuple[str | None, int | None]:
    """``["rows", 3, "unit"]`` → ("unit", 3); ``["cols", "sensor_id", 5]`` → ("sensor_id", 5)."""
    if len(path) >= 3 and path[0] == "rows" and isinstance(path[1], int):
        return str(path[2]), path[1]
    if len(path) >= 3 and path[0] == "cols" and isinstance(path[2], int):
        return str(path[1]), path[2]
    if not path:
        return None, None
    return ".".join(f"[{p}]" if isinstance(p, int) else p for p in path).replace(".[", "["), None
