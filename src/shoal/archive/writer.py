"""The archive writer: buffer rows per partition folder, roll them into Parquet files atomically.

No MQTT here (``shoal.archive.service`` feeds it). The order of one rollover:

1. ``take_due`` removes a partition's buffer and returns a ``FileJob`` (rows, final path); its
   bytes still count against the memory budget (``in_flight_bytes``) until written;
2. ``write_job`` (safe to run on a worker thread) writes the rows to a hidden temporary file
   in the final folder, fsyncs it, renames it to its final name, and fsyncs the folder;
3. ``done`` records the file and releases its bytes from the budget.

So a reader sees a part file whole or not at all; a crash leaves at most a hidden ``.tmp``
file, which readers skip. Rows still buffered when the process is killed are lost (a clean
stop flushes them): the archive is a best-effort record of what the broker delivered, and
replay reports any gap it leaves in a gateway's sequence.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import polars as pl

from shoal.archive.layout import Kind, file_name, partition_dir, temp_path
from shoal.archive.records import (
    BatchRecord,
    batch_frame,
    batch_record,
    record_size,
    result_rows,
)
from shoal.archive.rollover import Buffers, RolloverPolicy
from shoal.schemas.results import Deduplicator, WindowMessage

log = logging.getLogger(__name__)

Compression = Literal["zstd", "lz4", "snappy", "uncompressed"]
RESULTS_ORDER: Final = ("start", "window", "partition", "key")
"""Result files are sorted so that row-group statistics prune by window start; raw batches
stay in receive order."""


@dataclass(frozen=True, slots=True)
class FileJob:
    """One part file to write."""

    kind: Kind
    path: Path
    frame: pl.DataFrame
    bytes: int


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """A part file that is in place."""

    kind: Kind
    path: Path
    rows: int
    file_bytes: int
    seconds: float


@dataclass
class WriterStats:
    """What an archive writer has done."""

    batches: int = 0
    result_messages: int = 0
    result_rows: int = 0
    duplicate_results: int = 0
    unreadable_results: int = 0
    files: int = 0
    rows_written: int = 0
    file_bytes: int = 0
    write_seconds: float = 0.0
    peak_buffered_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class ArchiveWriter:
    """Buffers archived rows and rolls them into part files (see the module docstring).

    Args:
        root: the archive folder.
        policy: rollover thresholds and the memory budget.
        compression: Parquet compression codec.
        writer_id: goes into file names (random if empty).
        monotonic: seconds clock for buffer ages and write times (tests inject one).
    """

    def __init__(
        self,
        root: Path,
        policy: RolloverPolicy | None = None,
        *,
        compression: Compression = "zstd",
        writer_id: str = "",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.policy = policy or RolloverPolicy()
        self.compression = compression
        self.writer_id = writer_id or secrets.token_hex(4)
        self.monotonic = monotonic
        self.buffers = Buffers(self.policy)
        self.kinds: dict[Path, Kind] = {}
        self.dedup = Deduplicator()
        self.stats = WriterStats()
        self.in_flight_bytes = 0
        self._counter = 0

    # -- input -------------------------------------------------------------------------------

    def add_batch(
        self, stream: str, topic: str, payload: bytes, content_type: str | None, received_ms: int
    ) -> bool:
        """Buffer one raw batch; True if a partition reached a size threshold."""
        self.stats.batches += 1
        record = batch_record(topic, payload, content_type, received_ms)
        return self._add(
            "batches", stream, record, rows=1, size=record_size(record), at_ms=received_ms
        )

    def add_results(self, message: WindowMessage, received_ms: int) -> bool:
        """Buffer a window message unless its identity was archived already."""
        if not self.dedup.first_time(message.copy_key):
            self.stats.duplicate_results += 1
            return False
        self.stats.result_messages += 1
        self.stats.result_rows += message.frame.height
        if message.frame.height == 0:
            return False
        rows = result_rows(message, received_ms)
        size = int(rows.estimated_size())
        return self._add(
            "results", message.pipeline, rows, rows=rows.height, size=size, at_ms=message.start
        )

    def _add(
        self,
        kind: Kind,
        name: str,
        chunk: pl.DataFrame | BatchRecord,
        *,
        rows: int,
        size: int,
        at_ms: int,
    ) -> bool:
        folder = partition_dir(self.root, kind, name, at_ms)
        self.kinds[folder] = kind
        full = self.buffers.add(
            folder, chunk, rows=rows, size=size, first_ms=at_ms, now_s=self.monotonic()
        )
        buffered = self.buffers.bytes + self.in_flight_bytes
        self.stats.peak_buffered_bytes = max(self.stats.peak_buffered_bytes, buffered)
        return full

    @property
    def over_budget(self) -> bool:
        """Whether buffered plus in-flight bytes exceed the budget (stop reading input)."""
        return self.buffers.bytes + self.in_flight_bytes > self.policy.max_buffered_bytes

    # -- rollover ------------------------------------------------------------------------------

    def take_due(self, *, everything: bool = False) -> list[FileJob]:
        """Remove the partitions that must roll over now (all of them with ``everything``)."""
        folders = (
            self.buffers.folders()
            if everything
            else self.buffers.due(self.monotonic(), in_flight_bytes=self.in_flight_bytes)
        )
        jobs = []
        for folder in folders:
            part = self.buffers.take(folder)
            kind = self.kinds.pop(folder)
            self._counter += 1
            path = folder / file_name(self.writer_id, self._counter, part.first_ms)
            jobs.append(FileJob(kind, path, _frame(kind, part.chunks), part.bytes))
            self.in_flight_bytes += part.bytes
        return jobs

    def write_job(self, job: FileJob) -> WrittenFile:
        """Write one part file atomically (runs on any thread; touches no shared state)."""
        started = self.monotonic()
        size = write_parquet_atomically(job.frame, job.path, self.compression)
        return WrittenFile(job.kind, job.path, job.frame.height, size, self.monotonic() - started)

    def done(self, job: FileJob, written: WrittenFile | None) -> None:
        """Release a job's bytes; record the file (None: the write failed, rows are lost)."""
        self.in_flight_bytes -= job.bytes
        if written is None:
            return
        self.stats.files += 1
        self.stats.rows_written += written.rows
        self.stats.file_bytes += written.file_bytes
        self.stats.write_seconds += written.seconds
        self.stats.by_kind[written.kind] = self.stats.by_kind.get(written.kind, 0) + 1

    def flush(self) -> list[WrittenFile]:
        """Write every buffered partition now, on this thread (at shutdown and in tests)."""
        out = []
        for job in self.take_due(everything=True):
            written = self.write_job(job)
            self.done(job, written)
            out.append(written)
        return out


def _frame(kind: Kind, chunks: list[Any]) -> pl.DataFrame:
    if kind == "batches":
        return batch_frame(chunks)
    frame: pl.DataFrame = (
        chunks[0] if len(chunks) == 1 else pl.concat(chunks, how="diagonal_relaxed")
    )
    return frame.sort(*RESULTS_ORDER, maintain_order=True)


def write_parquet_atomically(frame: pl.DataFrame, path: Path, compression: Compression) -> int:
    """Write ``frame`` to ``path`` via a hidden temporary file and a rename; returns its size.

    The temporary file is fsynced before the rename and the folder after it, so after a crash
    the final name holds either nothing or the whole file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        frame.write_parquet(tmp, compression=compression, statistics=True)
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        size = tmp.stat().st_size
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return size
