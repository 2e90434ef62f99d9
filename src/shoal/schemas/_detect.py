"""Which syntax a payload is read as (JSON text or MsgPack), and why, in words.

The first byte decides where it can (``{`` or white space: JSON; a MsgPack map header:
MsgPack); otherwise the MQTT 5 content type, then the payload format indicator, then whether
the payload looks like text. The reason travels with every refusal (``InputError.assumed``),
so a device engineer whose JSON was read as MsgPack sees why. Never imports beyond ``schemas``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from shoal.schemas._model import GENERIC_JSON_TYPES, GENERIC_MSGPACK_TYPES, Encoding

Syntax = Literal["JSON", "MsgPack"]

_JSON_WHITESPACE: Final = {0x20: "a space", 0x09: "a tab", 0x0A: "a line feed", 0x0D: "a CR"}
_BOM: Final = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class Detected:
    """The syntax a payload is read as, and the reason in words (``"it starts with '{'"``)."""

    syntax: Syntax
    because: str


def is_msgpack_map_header(byte: int) -> bool:
    """Whether ``byte`` starts a MsgPack map (fixmap 0x80-0x8f, map16 0xde, map32 0xdf)."""
    return 0x80 <= byte <= 0x8F or byte in (0xDE, 0xDF)


def detect_syntax(
    payload: bytes,
    *,
    content_type: str | None = None,
    declared: Encoding | None = None,
    payload_format: int | None = None,
) -> Detected:
    """How to read ``payload`` (not empty): JSON text or MsgPack, with the reason.

    Args:
        payload: the MQTT payload, at least one byte.
        content_type: the MQTT 5 content type as received, for the reason's wording.
        declared: the encoding that content type declares (None: none or a generic type).
        payload_format: the MQTT 5 payload format indicator (1: UTF-8 text), if set.
    """
    first = payload[0]
    if first == ord("{"):
        return Detected("JSON", "it starts with '{'")
    if first in _JSON_WHITESPACE:
        return Detected("JSON", f"it starts with {_JSON_WHITESPACE[first]}, as only JSON text can")
    if is_msgpack_map_header(first):
        return Detected("MsgPack", f"its first byte 0x{first:02x} starts a MsgPack map")
    # No batch in either syntax starts like this: pick what the publisher meant, to say
    # something useful about it.
    by_type = _syntax_of_content_type(content_type, declared)
    if by_type is not None:
        return Detected(by_type, f"the content type {content_type!r} says so")
    if payload_format == 1:
        return Detected(
            "JSON", "the publisher marked it as UTF-8 text (payload format indicator 1)"
        )
    if payload.startswith(_BOM):
        return Detected("JSON", "it starts with a UTF-8 byte-order mark, as text does")
    if 0x21 <= first <= 0x7E:
        return Detected(
            "JSON", f"its first byte {chr(first)!r} is a printable character, as text starts"
        )
    return Detected(
        "MsgPack", f"its first byte 0x{first:02x} is neither '{{' nor a printable character"
    )


def _syntax_of_content_type(content_type: str | None, declared: Encoding | None) -> Syntax | None:
    if declared is not None:
        return "JSON" if declared.is_json else "MsgPack"
    if not content_type:
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    if media in GENERIC_JSON_TYPES:
        return "JSON"
    if media in GENERIC_MSGPACK_TYPES:
        return "MsgPack"
    return None
