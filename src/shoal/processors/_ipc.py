"""Arrow IPC stream bytes ↔ polars frames, for partials and checkpoints."""

from __future__ import annotations

import io
from typing import Literal

import polars as pl
from polars.exceptions import PanicException


def to_ipc(
    frame: pl.DataFrame | None, compression: Literal["uncompressed", "lz4", "zstd"] = "uncompressed"
) -> bytes | None:
    """Serialise a frame (None or empty → None)."""
    if frame is None or frame.height == 0:
        return None
    buffer = io.BytesIO()
    frame.write_ipc_stream(buffer, compression=compression)
    return buffer.getvalue()


def from_ipc(data: bytes | None) -> pl.DataFrame | None:
    """Parse bytes written by ``to_ipc``; corrupt bytes raise ``ValueError``."""
    if data is None:
        return None
    try:
        return pl.read_ipc_stream(io.BytesIO(data))
    except PanicException as exc:
        # Some corrupt streams make polars' reader panic, and a panic is a BaseException that
        # would get past every ``except Exception`` bad-input policy.
        raise ValueError(f"corrupt Arrow IPC stream: {exc}") from exc
