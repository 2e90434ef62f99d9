"""Session window arithmetic: the gap-connected runs of a key's timestamps, and their merge.

A session of a key is a maximal run of its timestamps in which consecutive ones (in time
order) are **less than** ``gap_ms`` apart: a row exactly ``gap_ms`` after the previous one
opens a new session ("closed after ``gap_ms`` without rows"). A session covers the half-open
interval ``[first_ts, last_ts + gap_ms)`` like every shoal window: a row inside it joins it,
and two sessions whose intervals overlap are one. With ``max_duration_ms`` = M the timeline is
also cut on the epoch grid ``k * M`` (floor division, like the aligned windows): a session
never holds timestamps of two grid cells, so it spans less than M.

Why these rules make sessions exact for any number of workers and partitions: the sessions
of a key are a deterministic function of its whole set of timestamps, and a worker's sessions
of one batch (``label_rows``) are pieces of them — every piece lies inside exactly one true
session, and the pieces of one true session chain by overlap. ``merge_intervals`` joins
overlapping pieces (union-find over intervals, done as a sort and a segmented running
maximum), so merging the pieces of any batch split in any order and any grouping gives the
sessions of all rows (``tests/unit/processors/test_sessions.py`` checks this against the
polars oracle ``with_sessions``). The grid cut is what keeps ``max_duration_ms`` mergeable: a
cut at ``first_ts + k * M`` of the merged session would move when an earlier row arrives and
needs the rows, while the epoch grid is the same for every worker and every batch.

Closing (what the combiner must respect): a batch's run is *late* as a whole when the window
its first row would open alone, ``[first_ts, first_ts + gap_ms)``, ended ``lateness_ms``
before the gateway's watermark (``late_from``). A non-late run then starts more than
``gap_ms`` after any session whose ``close_from`` the watermark has passed, so it can neither
join nor bridge a closed session (docs/guarantees.md, "Session windows").

Imports no other shoal module but ``errors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import ConfigError, UsageError

Int64Array = npt.NDArray[np.int64]

SESSION_KIND: Final = "session"
"""The ``kind`` of a session window (not an entry of ``windows.WINDOW_KINDS``: its windows
do not follow from a timestamp alone, so ``PartialBuilder`` labels them with ``label_rows``)."""


@dataclass(frozen=True, slots=True)
class Sessions:
    """Sessions of a set of rows or intervals, in ascending (key, first_ts) order.

    Attributes:
        label: session index of each input row / interval (in input order).
        key: key id of each session.
        first_ts: smallest timestamp of each session (its start and its identity).
        last_ts: largest timestamp of each session.
    """

    label: Int64Array
    key: Int64Array
    first_ts: Int64Array
    last_ts: Int64Array

    def __len__(self) -> int:
        return len(self.first_ts)


@dataclass(frozen=True, slots=True)
class SessionRule:
    """The settings of a session window and the arithmetic they define.

    Attributes:
        gap_ms: timestamps less than this apart belong to one session (> 0).
        max_duration_ms: the epoch grid that cuts sessions (None: no cut).
    """

    gap_ms: int
    max_duration_ms: int | None = None

    def __post_init__(self) -> None:
        if self.gap_ms <= 0:
            raise ConfigError(f"session gap_ms must be positive, got {self.gap_ms}")
        if self.max_duration_ms is not None and self.max_duration_ms <= 0:
            raise ConfigError(
                f"session max_duration_ms must be positive, got {self.max_duration_ms}"
            )

    # -- the definition, for one key --------------------------------------------------------

    def sessions_of(self, timestamps: list[int]) -> list[tuple[int, int]]:
        """``(first_ts, last_ts)`` of every session of one key's timestamps (the definition)."""
        out: list[tuple[int, int]] = []
        for t in sorted(timestamps):
            if out and t - out[-1][1] < self.gap_ms and self.cell_of(t) == self.cell_of(out[-1][0]):
                out[-1] = (out[-1][0], t)
            else:
                out.append((t, t))
        return out

    def cell_of(self, ts_ms: int) -> int:
        """Grid cell of a timestamp (0 for every timestamp without ``max_duration_ms``)."""
        return 0 if self.max_duration_ms is None else ts_ms // self.max_duration_ms

    def end(self, last_ts: int) -> int:
        """Exclusive end of a session whose last row is at ``last_ts`` (results' ``end``)."""
        return last_ts + self.gap_ms

    def late_from(self, first_ts: int, lateness_ms: int) -> int:
        """Watermark from which a batch's run starting at ``first_ts`` is late as a whole."""
        return first_ts + self.gap_ms + lateness_ms

    def close_from(self, last_ts: int, lateness_ms: int) -> int:
        """Watermark from which no non-late run can reach the session: it may close."""
        return last_ts + 2 * self.gap_ms + lateness_ms

    # -- vectorised: the worker's and the combiner's hot paths ------------------------------

    def cells(self, ts: Int64Array) -> Int64Array:
        """``cell_of`` for every timestamp."""
        if self.max_duration_ms is None:
            return np.zeros(len(ts), dtype=np.int64)
        return ts // self.max_duration_ms

    def label_rows(self, key: Int64Array, ts: Int64Array) -> Sessions:
        """The sessions of a batch's rows (``key``: a key id per row, ``ts``: its time)."""
        _check_lengths(key, ts)
        order = np.lexsort((ts, key))
        k, t = key[order], ts[order]
        new = np.ones(len(t), dtype=np.bool_)
        if len(t) > 1:
            cell = self.cells(t)
            new[1:] = (k[1:] != k[:-1]) | (np.diff(t) >= self.gap_ms) | (cell[1:] != cell[:-1])
        starts = np.flatnonzero(new)
        label = np.empty(len(t), dtype=np.int64)
        label[order] = np.cumsum(new) - 1
        last = np.append(starts[1:], len(t))[: len(starts)] - 1
        return Sessions(label, k[starts], t[starts], t[last])

    def merge_intervals(
        self, key: Int64Array, first_ts: Int64Array, last_ts: Int64Array
    ) -> Sessions:
        """Join pieces of sessions (one per index) that overlap: the combiner's merge.

        Every piece must hold timestamps of one grid cell (``label_rows`` makes only such).
        Sorted by (key, cell, first_ts), a piece starts a new session unless it begins less
        than ``gap_ms`` after the largest ``last_ts`` seen so far in its (key, cell): a
        segmented running maximum, computed on ranks offset per segment so that one
        ``np.maximum.accumulate`` serves every segment.
        """
        _check_lengths(key, first_ts)
        _check_lengths(key, last_ts)
        n = len(first_ts)
        if n == 0:
            empty = np.zeros(0, dtype=np.int64)
            return Sessions(empty, empty, empty, empty)
        cell = self.cells(first_ts)
        order = _sort_order(key, cell, first_ts)
        k, c, f, last = key[order], cell[order], first_ts[order], last_ts[order]
        segment_start = np.ones(n, dtype=np.bool_)
        segment_start[1:] = (k[1:] != k[:-1]) | (c[1:] != c[:-1])
        segment = np.cumsum(segment_start) - 1
        reach = _segmented_running_max(last, segment)
        new = segment_start.copy()
        new[1:] |= f[1:] - reach[:-1] >= self.gap_ms
        starts = np.flatnonzero(new)
        label = np.empty(n, dtype=np.int64)
        label[order] = np.cumsum(new) - 1
        return Sessions(label, k[starts], f[starts], np.maximum.reduceat(last, starts))

    # -- the oracle: plain polars over all rows ---------------------------------------------

    def with_sessions(self, frame: pl.DataFrame, key: str = "key", ts: str = "ts") -> pl.DataFrame:
        """``frame`` sorted by key and time, with each row's session ``start`` and ``end``."""
        new = pl.col(key).ne_missing(pl.col(key).shift(1)) | (pl.col(ts).diff() >= self.gap_ms)
        if self.max_duration_ms is not None:
            cell = pl.col(ts) // self.max_duration_ms
            new = new | (cell != cell.shift(1))
        new = new.fill_null(value=True)
        return (
            frame.sort([key, ts], nulls_last=True)
            .with_columns(new.cum_sum().alias("_session"))
            .with_columns(
                pl.col(ts).min().over("_session").alias("start"),
                (pl.col(ts).max().over("_session") + self.gap_ms).alias("end"),
            )
            .drop("_session")
        )


_PACKED_LIMIT: Final = 1 << 62


def _span(values: Int64Array) -> tuple[int, int]:
    """(smallest value, number of distinct positions from it to the largest)."""
    low = int(values.min())
    return low, int(values.max()) - low + 1


def _sort_order(key: Int64Array, cell: Int64Array, first_ts: Int64Array) -> Int64Array:
    """The order by (key, cell, first_ts), as ``np.lexsort((first_ts, cell, key))``.

    One stable sort of a packed int64 where the three fit (timsort then runs in about linear
    time over already sorted chunks), else lexsort.
    """
    key_low, keys = _span(key)
    cell_low, cells = _span(cell)
    first_low, firsts = _span(first_ts)
    if keys * cells * firsts < _PACKED_LIMIT:
        packed = ((key - key_low) * cells + (cell - cell_low)) * firsts + (first_ts - first_low)
        order: Int64Array = np.argsort(packed, kind="stable")
        return order
    return np.lexsort((first_ts, cell, key))


def _segmented_running_max(values: Int64Array, segment: Int64Array) -> Int64Array:
    """Running maximum of ``values`` restarting at each new ``segment`` (ascending ids).

    Offsetting each segment above the previous ones makes one ``np.maximum.accumulate``
    serve them all: by value span where it fits in int64, else by rank (one more sort).
    """
    n = len(values)
    low, span = _span(values)
    if (int(segment[-1]) + 1) * span < _PACKED_LIMIT:
        offset = segment * span
        packed: Int64Array = np.maximum.accumulate(offset + (values - low)) - offset + low
        return packed
    by_value = np.argsort(values, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_value] = np.arange(n)
    return values[by_value][np.maximum.accumulate(segment * n + rank) - segment * n]


def _check_lengths(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> None:
    if len(a) != len(b):
        raise UsageError(f"session arrays of different lengths: {len(a)} and {len(b)}")
