"""The registry of window kinds: each kind owns its assignment of timestamps to windows.

A ``WindowKind`` answers "which windows contain this timestamp" three ways, which must agree:
for one timestamp (``window_starts``, the readable definition, tested as a table of boundary
cases), as a polars reference over a frame (``with_window_starts``, the property tests'
oracle) and as the numpy hot path over a batch (``assign``, what ``PartialBuilder`` runs).
Every window is half-open, ``[start, start + size_ms)``: combiners judge lateness and close
windows from ``start`` and ``size_ms`` alone, whatever the kind.

Today's kinds are epoch-aligned: a timestamp ``t`` belongs to the hopping windows whose start
is ``floor(t / slide) * slide - j * slide`` for ``j`` in ``0 .. size/slide - 1``; a tumbling
window is a hopping one with ``slide = size``. Floor division makes negative timestamps fall
into the window *before* zero, like positive ones.

A *count* window (``kind = "count"``, ``n`` rows per key) is not a set of timestamps: its
members depend on the order of all of a key's rows. For lateness and closing it is judged row
by row, each row as the 1 ms window ``[ts, ts + 1)`` (``size_ms = 1``), so the combiner's rules
stay the same; the grouping into windows of ``n`` rows happens at the combiner once rows are
final (``processors/count.py``), with ``CountWindows.with_count_index`` as its reference.

Imports no other shoal module (``spec`` reads window tables into ``WindowSpec`` and checks the
kind against ``WINDOW_KINDS``). Adding a window kind: docs/architecture.md, "Adding a window
kind".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt
import polars as pl

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """One window of a pipeline spec (``spec.parse_pipeline`` reads and checks it).

    Attributes:
        name: label carried by results (``tumbling-10s`` unless given).
        kind: a name in ``WINDOW_KINDS``: ``tumbling`` (slide = size), ``hopping`` or
            ``count``.
        size_ms: window length.
        slide_ms: distance between window starts (= size for tumbling).
        gap_ms: for ``kind = "session"`` only (``sessions.SessionRule``): rows less than this
            apart are one session; None for aligned kinds.
        max_duration_ms: for sessions only: the epoch grid that cuts sessions (None: none).
        count: rows per window and key for count windows (``size_ms`` and ``slide_ms`` are
            then 1: each row is judged for lateness as the 1 ms window at its time); 0 for
            time windows.
    """

    name: str
    kind: str
    size_ms: int
    slide_ms: int
    gap_ms: int | None = None
    max_duration_ms: int | None = None
    count: int = 0

    @property
    def by_count(self) -> bool:
        """Whether this is a count window (``n`` rows per key) rather than a time window."""
        return self.count > 0

    @property
    def windows_per_row(self) -> int:
        """How many windows each timestamp falls into."""
        return self.size_ms // self.slide_ms


@dataclass(frozen=True, slots=True)
class Assignment:
    """The windows of a batch's rows, as dense *slots* (small ids: cheap to group on).

    Memberships are row-major: row ``i`` has memberships ``i * per_row`` to
    ``(i + 1) * per_row - 1`` (repeat the row's columns ``per_row`` times to align them).

    Attributes:
        per_row: windows per row.
        slot: slot of each membership (non-negative).
        base: start of the window of slot 0.
        step: distance between the starts of consecutive slots.
    """

    per_row: int
    slot: Int64Array
    base: int
    step: int

    def starts(self, slot: Int64Array) -> Int64Array:
        """The window start of each slot."""
        return slot * self.step + self.base


class WindowKind(Protocol):
    """A kind of window: how its settings read and which windows hold a timestamp."""

    @property
    def name(self) -> str:
        """The ``kind`` of a ``[[windows]]`` table."""

    @property
    def takes_slide(self) -> bool:
        """Whether a spec sets ``slide_ms`` (otherwise it equals ``size_ms``)."""

    def window_starts(self, ts_ms: int, window: WindowSpec) -> list[int]:
        """Starts of every window containing ``ts_ms``, oldest first (the definition)."""

    def with_window_starts(
        self, frame: pl.DataFrame, window: WindowSpec, ts: str = "ts"
    ) -> pl.DataFrame:
        """``frame`` with a ``start`` column, a row repeated once per window (reference)."""

    def assign(self, ts: Int64Array, window: WindowSpec) -> Assignment:
        """The windows of every timestamp of a batch (hot path; ``ts`` is not empty)."""


@dataclass(frozen=True, slots=True)
class AlignedWindows:
    """Windows aligned to the epoch, one starting every ``slide_ms`` (tumbling, hopping)."""

    name: str
    takes_slide: bool

    def window_starts(self, ts_ms: int, window: WindowSpec) -> list[int]:
        """Starts of every window containing ``ts_ms``, oldest first."""
        last = (ts_ms // window.slide_ms) * window.slide_ms
        return [last - j * window.slide_ms for j in reversed(range(window.windows_per_row))]

    def start_expr(self, window: WindowSpec, ts: str = "ts") -> pl.Expr:
        """Polars expression: start of the latest window containing each row's timestamp."""
        return (pl.col(ts) // window.slide_ms) * window.slide_ms

    def with_window_starts(
        self, frame: pl.DataFrame, window: WindowSpec, ts: str = "ts"
    ) -> pl.DataFrame:
        """``frame`` with a ``start`` column; rows are repeated once per hopping window."""
        last = self.start_expr(window, ts)
        if window.windows_per_row == 1:
            return frame.with_columns(last.alias("start"))
        slide = window.slide_ms
        starts = pl.concat_list([last - j * slide for j in range(window.windows_per_row)])
        return frame.with_columns(starts.alias("start")).explode("start")

    def assign(self, ts: Int64Array, window: WindowSpec) -> Assignment:
        """Slot ``k`` is the window starting at ``(first + k) * slide_ms``; newest first per row."""
        per_row = window.windows_per_row
        newest = ts // window.slide_ms  # the newest window of each row, in slides since 0
        first = int(newest.min()) - (per_row - 1)
        if per_row == 1:
            slot = newest - first
        else:
            back = np.arange(per_row, dtype=np.int64)
            slot = (newest[:, None] - back[None, :]).ravel() - first
        return Assignment(per_row, slot, first * window.slide_ms, window.slide_ms)


COUNT_ORDER: Final = ("ts", "gateway_id", "seq", "row")
"""The event order of a key's rows that count windows follow: event time, then gateway, batch
and row within the batch: the same for any number of workers and any delivery order."""


@dataclass(frozen=True, slots=True)
class CountWindows:
    """Every ``n`` rows of a key in event order (``COUNT_ORDER``) form one window.

    As a ``WindowKind`` it answers for lateness only: each row is its own 1 ms window at its
    timestamp (``size_ms = 1``), so a row is late exactly when a time window ending right
    after it would be. ``with_count_index`` is the grouping itself (the reference).
    """

    name: str = "count"
    takes_slide: bool = False

    def window_starts(self, ts_ms: int, window: WindowSpec) -> list[int]:
        """The row's own 1 ms window: ``[ts_ms]``."""
        del window
        return [ts_ms]

    def with_window_starts(
        self, frame: pl.DataFrame, window: WindowSpec, ts: str = "ts"
    ) -> pl.DataFrame:
        """``frame`` with ``start`` = the row's timestamp."""
        del window
        return frame.with_columns(pl.col(ts).alias("start"))

    def assign(self, ts: Int64Array, window: WindowSpec) -> Assignment:
        """Slot ``k`` is the millisecond ``min(ts) + k``."""
        del window
        first = int(ts.min())
        return Assignment(1, ts - first, first, 1)

    def with_count_index(
        self, frame: pl.DataFrame, window: WindowSpec, key: str = "key"
    ) -> pl.DataFrame:
        """Reference: each row's window ordinal within its key, as ``index`` (rank // n).

        ``frame``: final rows with ``key`` and the ``COUNT_ORDER`` columns.
        """
        ordered = frame.sort(key, *COUNT_ORDER)
        rank = pl.int_range(pl.len(), dtype=pl.Int64).over(key)
        return ordered.with_columns((rank // window.count).alias("index"))


TUMBLING: Final = AlignedWindows("tumbling", takes_slide=False)
HOPPING: Final = AlignedWindows("hopping", takes_slide=True)
COUNT: Final = CountWindows()

WINDOW_KINDS: Final[dict[str, WindowKind]] = {k.name: k for k in (TUMBLING, HOPPING, COUNT)}
"""Every window kind a pipeline spec may name."""


def kind_of(window: WindowSpec) -> WindowKind:
    """The kind of a window spec."""
    return WINDOW_KINDS[window.kind]


def window_start(ts_ms: int, window: WindowSpec) -> int:
    """Start of the latest window containing ``ts_ms`` (the only one, for tumbling)."""
    return kind_of(window).window_starts(ts_ms, window)[-1]


def window_starts(ts_ms: int, window: WindowSpec) -> list[int]:
    """Starts of every window containing ``ts_ms``, oldest first."""
    return kind_of(window).window_starts(ts_ms, window)


def window_end(start_ms: int, window: WindowSpec) -> int:
    """Exclusive end of the window starting at ``start_ms`` (the same rule for every kind)."""
    return start_ms + window.size_ms


def with_window_starts(frame: pl.DataFrame, window: WindowSpec, ts: str = "ts") -> pl.DataFrame:
    """``frame`` with a ``start`` column; rows are repeated once per window containing them."""
    return kind_of(window).with_window_starts(frame, window, ts)
