"""MsgPack in pieces: what was packed once and kept goes into a checkpoint by reference.

A checkpoint is ``msgpack.packb(snapshot, use_bin_type=True)``; ``parts`` writes the same
bytes as a list of pieces, which the file takes one by one (``write_atomically``), so that
the large buffers a snapshot holds are not copied into a packer's buffer every checkpoint.
A ``Packed`` value is MsgPack already: its pieces go in as they are, large buffers among
them behind their bin header.

Imports msgpack only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

Part = bytes | memoryview
"""A piece of packed MsgPack (a contiguous ``memoryview``: its bytes)."""

BY_REFERENCE_BYTES: Final = 4096
"""Buffers at least this long go into a ``Packed`` map by reference; shorter ones are copied
(a piece costs a write of its own once it is more than the file's buffer holds)."""


@dataclass(frozen=True, slots=True)
class Packed:
    """A value in MsgPack, as pieces: ``b"".join(parts)`` is ``packb(value, use_bin_type=True)``.

    The pieces stay valid while they are held: a buffer given by reference must not change.
    """

    parts: tuple[Part, ...]

    @classmethod
    def map(cls, value: dict[str, Any]) -> Packed:
        """``value`` packed, its large buffers by reference.

        Values that are buffers (``bytes``, a contiguous ``memoryview``) of
        ``BY_REFERENCE_BYTES`` or more go in as they are, behind their bin header; the rest
        is copied.
        """
        packer = msgpack.Packer(use_bin_type=True)
        parts: list[Part] = []
        run: list[bytes] = [packer.pack_map_header(len(value))]
        for name, item in value.items():
            run.append(packer.pack(name))
            size = _buffer_size(item)
            if size < BY_REFERENCE_BYTES:
                run.append(packer.pack(item))
                continue
            run.append(bin_header(size))
            parts += [b"".join(run), item]
            run = []
        parts.append(b"".join(run))
        return cls(tuple(parts))

    @classmethod
    def array(cls, items: Sequence[Packed]) -> Packed:
        """An array of packed values."""
        header: bytes = msgpack.Packer().pack_array_header(len(items))
        return cls((header, *(part for item in items for part in item.parts)))


def parts(value: Any) -> list[Part]:
    """``msgpack.packb(value, use_bin_type=True)`` in pieces: nothing ``Packed`` copied.

    ``Packed`` values go in as their pieces; a map holding one (at any depth of maps) is
    packed key by key, in its order; any other value whole, as its packer's own buffer.
    """
    if isinstance(value, Packed):
        return list(value.parts)
    if not _holds_packed(value):
        return [_whole(value)]
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[Part] = [packer.pack_map_header(len(value))]
    for name, item in value.items():
        pieces.append(packer.pack(name))
        pieces += parts(item)
    return pieces


def _buffer_size(value: Any) -> int:
    """Bytes in ``value`` if it is a buffer MsgPack packs as bin, else -1."""
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, memoryview) and value.c_contiguous:
        return value.nbytes  # what ``packb`` takes of it, whatever its item format
    return -1


def _holds_packed(value: Any) -> bool:
    """Whether ``value`` is a map with a ``Packed`` value (in maps within it too)."""
    return isinstance(value, dict) and any(
        isinstance(item, Packed) or _holds_packed(item) for item in value.values()
    )


def _whole(value: Any) -> memoryview:
    """``value`` packed, as the packer's own buffer (it stays alive while it is read)."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack(value)
    buffer: memoryview = packer.getbuffer()
    return buffer


def bin_header(size: int) -> bytes:
    """MsgPack's header of a bin of ``size`` bytes (bin 8, 16 or 32, as ``packb`` picks)."""
    if size < 2**8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 2**16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")
