"""When to seal a batch: by size (``batch_size`` rows) and by age (``max_delay_ms``).

Pure: time comes in as arguments (monotonic seconds), so tests drive it with ``FakeClock``.
No I/O, no encoding; the gateway encodes and spools what this hands out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shoal.errors import ConfigError
from shoal.gateway._blocks import concat_blocks
from shoal.schemas import Measurements


@dataclass(frozen=True, slots=True)
class _Pending:
    block: Measurements
    arrived_s: float


class Batcher:
    """Collects blocks of measurements and cuts them into batches.

    Rows leave in the order they arrived. A full batch holds exactly ``batch_size`` rows;
    a partial batch is handed out once its oldest row has waited ``max_delay_ms``.

    Args:
        batch_size: rows per full batch.
        max_delay_ms: longest a row waits before a partial batch is sealed.
    """

    def __init__(self, batch_size: int, max_delay_ms: int) -> None:
        if batch_size <= 0 or max_delay_ms <= 0:
            raise ConfigError("batch_size and max_delay_ms must be positive")
        self.batch_size = batch_size
        self.max_delay_s = max_delay_ms / 1000.0
        self._pending: deque[_Pending] = deque()
        self.rows = 0

    def add(self, block: Measurements, now_s: float) -> None:
        """Buffer ``block``, which arrived at ``now_s``."""
        if len(block):
            self._pending.append(_Pending(block, now_s))
            self.rows += len(block)

    def push_front(self, block: Measurements, arrived_s: float) -> None:
        """Put rows back at the front (they were handed out but could not be sealed)."""
        if len(block):
            self._pending.appendleft(_Pending(block, arrived_s))
            self.rows += len(block)

    @property
    def oldest_s(self) -> float | None:
        """When the oldest buffered row arrived (None when empty)."""
        return self._pending[0].arrived_s if self._pending else None

    def deadline_s(self) -> float | None:
        """When the buffered partial batch becomes due (None when empty)."""
        oldest = self.oldest_s
        return None if oldest is None else oldest + self.max_delay_s

    def take_full(self) -> list[tuple[Measurements, float]]:
        """Every full batch buffered, with the arrival time of its oldest row."""
        if self.rows < self.batch_size:
            return []
        return self._cut(self.rows - self.rows % self.batch_size)

    def take_due(self, now_s: float) -> list[tuple[Measurements, float]]:
        """Full batches, plus the partial one if its oldest row is ``max_delay_ms`` old."""
        out = self.take_full()
        deadline = self.deadline_s()
        if deadline is not None and now_s >= deadline:
            out.extend(self._cut(self.rows))
        return out

    def take_all(self) -> list[tuple[Measurements, float]]:
        """Everything buffered, as full batches and at most one partial one (``flush``)."""
        return self._cut(self.rows)

    def _cut(self, rows: int) -> list[tuple[Measurements, float]]:
        """Hand out the first ``rows`` rows in batches of at most ``batch_size``."""
        if rows <= 0:
            return []
        taken: list[_Pending] = []
        count = 0
        while count < rows:
            item = self._pending.popleft()
            taken.append(item)
            count += len(item.block)
        self.rows -= count
        joined = concat_blocks([t.block for t in taken])
        # Row span and arrival time of every block, to date the oldest row of each batch.
        spans: list[tuple[int, int, float]] = []
        offset = 0
        for item in taken:
            spans.append((offset, offset + len(item.block), item.arrived_s))
            offset += len(item.block)
        if count > rows:  # the last block was only partly used: return its tail
            self.push_front(joined.slice(rows, count), spans[-1][2])
        out: list[tuple[Measurements, float]] = []
        for start in range(0, rows, self.batch_size):
            stop = min(start + self.batch_size, rows)
            arrived = min(s for first, last, s in spans if first < stop and last > start)
            out.append((joined.slice(start, stop), arrived))
        return out
