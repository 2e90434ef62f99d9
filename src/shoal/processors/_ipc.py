"""Arrow IPC stream bytes ↔ polars frames, for partials and checkpoints."""

from __future__ import annotations

import io
from typing import Literal

import polars as pl


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
    """Parse bytes written by ``to_ipc``."""
    return None if data is None else pl.read_ipc_stream(io.BytesIO(data))
