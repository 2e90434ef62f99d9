"""When a buffered partition becomes a file: row, byte and age thresholds and a memory budget.

Pure bookkeeping: ``Buffers`` holds chunks (whatever the writer buffers: DataFrames of result
rows, tuples of raw batch rows) per partition folder, with their row counts and byte sizes, and
says which partitions to roll over; it never touches files. Every buffered byte counts against
``RolloverPolicy.max_buffered_bytes``; past it, the largest partitions roll first, so memory
stays bounded whatever the mix of partitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RolloverPolicy:
    """Thresholds that end a part file.

    Attributes:
        max_rows: rows per file.
        max_bytes: estimated in-memory bytes per file (Parquet is usually smaller).
        max_age_s: a partition's oldest buffered row waits at most this long.
        max_buffered_bytes: all partitions together, plus files being written.
    """

    max_rows: int = 1_000_000
    max_bytes: int = 32 * 2**20
    max_age_s: float = 60.0
    max_buffered_bytes: int = 128 * 2**20

    def __post_init__(self) -> None:
        """Refuse thresholds that would never roll over or never fit."""
        if self.max_rows < 1 or self.max_bytes < 1 or self.max_age_s <= 0:
            raise ConfigError("rollover thresholds must be positive")
        if self.max_buffered_bytes < self.max_bytes:
            raise ConfigError(
                f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least max_bytes "
                f"({self.max_bytes})"
            )


@dataclass
class PartBuffer:
    """What is buffered for one partition folder."""

    folder: Path
    first_ms: int
    opened_at_s: float
    chunks: list[Any] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0


class Buffers:
    """Chunks per partition folder and the rollover decisions (see the module docstring)."""

    def __init__(self, policy: RolloverPolicy) -> None:
        self.policy = policy
        self._parts: dict[Path, PartBuffer] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._parts)

    @property
    def rows(self) -> int:
        """Rows buffered in every partition."""
        return sum(p.rows for p in self._parts.values())

    def add(
        self, folder: Path, chunk: Any, *, rows: int, size: int, first_ms: int, now_s: float
    ) -> bool:
        """Buffer a chunk of ``rows`` rows and ``size`` bytes; True if its partition is full."""
        part = self._parts.get(folder)
        if part is None:
            part = self._parts[folder] = PartBuffer(folder, first_ms, now_s)
        part.chunks.append(chunk)
        part.rows += rows
        part.bytes += size
        self.bytes += size
        return part.rows >= self.policy.max_rows or part.bytes >= self.policy.max_bytes

    def due(self, now_s: float, *, in_flight_bytes: int = 0) -> list[Path]:
        """Partitions to roll now: full, old enough, or the largest while over budget."""
        policy = self.policy
        out = [
            folder
            for folder, part in self._parts.items()
            if part.rows >= policy.max_rows
            or part.bytes >= policy.max_bytes
            or now_s - part.opened_at_s >= policy.max_age_s
        ]
        total = self.bytes + in_flight_bytes - sum(self._parts[f].bytes for f in out)
        if total > policy.max_buffered_bytes:
            for folder, part in sorted(self._parts.items(), key=lambda kv: -kv[1].bytes):
                if total <= policy.max_buffered_bytes:
                    break
                if folder not in out:
                    out.append(folder)
                    total -= part.bytes
        return out

    def take(self, folder: Path) -> PartBuffer:
        """Remove and return a partition's buffer."""
        part = self._parts.pop(folder)
        self.bytes -= part.bytes
        return part

    def folders(self) -> list[Path]:
        """Every partition with buffered rows."""
        return list(self._parts)
