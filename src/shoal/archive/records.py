"""What one archived row holds: raw batches as received, window results in the result layout.

Raw batch rows keep the exact payload bytes and content type a worker saw, so a replay decodes
the same input. ``gateway_id`` and ``seq`` are peeked from the envelope (null when unreadable:
such a batch is dead-lettered by workers, and skipped by replay). ``topic`` is relative to the
topic root. Result rows are the result layout (``shoal.schemas.results``) plus ``received_at``.
The partition column of each kind (``stream``, ``pipeline``) lives in the folder name only.
"""

from __future__ import annotations

from typing import Final

import polars as pl

from shoal.schemas import peek_envelope
from shoal.schemas.results import WindowMessage

BATCH_SCHEMA: Final = pl.Schema(
    {
        "received_at": pl.Int64(),
        "topic": pl.String(),
        "gateway_id": pl.String(),
        "seq": pl.Int64(),
        "content_type": pl.String(),
        "payload": pl.Binary(),
    }
)
"""Columns of an archived raw batch (plus ``stream`` from the folder)."""


BatchRecord = tuple[int, str, str | None, int | None, str | None, bytes]
"""One raw batch row, in ``BATCH_SCHEMA`` order (buffered as a tuple: the payload is not copied
until its file is written)."""


def batch_record(
    topic: str, payload: bytes, content_type: str | None, received_ms: int
) -> BatchRecord:
    """One archived raw batch (``topic`` relative to the topic root)."""
    named = peek_envelope(payload)
    gateway_id, seq = named if named is not None else (None, None)
    return (received_ms, topic, gateway_id, seq, content_type, payload)


def record_size(record: BatchRecord) -> int:
    """Approximate bytes a buffered record holds (for the memory budget)."""
    return len(record[5]) + len(record[1]) + 64


def batch_frame(records: list[BatchRecord]) -> pl.DataFrame:
    """Buffered raw batch records as one frame (``BATCH_SCHEMA``)."""
    return pl.DataFrame(records, schema=BATCH_SCHEMA, orient="row")


def batch_row(
    topic: str, payload: bytes, content_type: str | None, received_ms: int
) -> pl.DataFrame:
    """One archived raw batch as a one-row frame."""
    return batch_frame([batch_record(topic, payload, content_type, received_ms)])


def result_rows(message: WindowMessage, received_ms: int) -> pl.DataFrame:
    """A window message's rows as archived (result layout without ``pipeline``)."""
    return message.frame.drop("pipeline").with_columns(
        pl.lit(received_ms, dtype=pl.Int64).alias("received_at")
    )
