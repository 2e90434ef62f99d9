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

A kind may also decide which of its merged (window, key) states are results (``emitted``,
with ``emitted_reference`` its polars twin). Tumbling and hopping emit every window holding a
row. A *sliding* window (``step_ms``, carried as ``slide_ms``) holds rows like a hopping one
but is emitted for a key only if the key has a row in its last step ``[end - step, end)``:
windows are triggered by arriving rows, quantised to the step grid. With ``step_ms = 1`` that
is eKuiper's sliding window, one window ``(t - size, t]`` per row time ``t``.

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
            ``sliding`` or ``count``.
        size_ms: window length.
        slide_ms: distance between window starts (= size for tumbling; a sliding window's
            ``step_ms``).
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
    With ``fan > 1`` a membership's slot is a *pane*: slot ``p`` stands for the windows of
    slots ``p`` to ``p + fan - 1`` (``PartialBuilder`` computes state per pane and fans it
    out, ``_panes.py``); ``expanded`` spells those windows out.

    Attributes:
        per_row: memberships per row.
        slot: slot of each membership (non-negative).
        base: start of the window of slot 0.
        step: distance between the starts of consecutive slots.
        fan: consecutive window slots each membership stands for.
    """

    per_row: int
    slot: Int64Array
    base: int
    step: int
    fan: int = 1

    def starts(self, slot: Int64Array) -> Int64Array:
        """The window start of each slot."""
        return slot * self.step + self.base

    def expanded(self) -> Assignment:
        """The same windows with one membership per window (``fan`` 1), row-major."""
        if self.fan == 1:
            return self
        back = np.arange(self.fan, dtype=np.int64)
        slot = (self.slot[:, None] + back[None, :]).ravel()
        return Assignment(self.per_row * self.fan, slot, self.base, self.step)


class WindowKind(Protocol):
    """A kind of window: how its settings read and which windows hold a timestamp."""

    @property
    def name(self) -> str:
        """The ``kind`` of a ``[[windows]]`` table."""

    @property
    def takes_slide(self) -> bool:
        """Whether a spec sets the slide (otherwise it equals ``size_ms``)."""

    @property
    def slide_key(self) -> str:
        """The setting of a ``[[windows]]`` table that holds the slide, if it takes one."""

    @property
    def needs_last_ts(self) -> bool:
        """Whether ``emitted`` reads each state's latest event time (``last_ts``)."""

    def emitted(
        self, start: Int64Array, last_ts: Int64Array | None, window: WindowSpec
    ) -> npt.NDArray[np.bool_] | None:
        """Which merged (window, key) states are results (None: every one).

        By window start and latest event time (``last_ts`` is None unless ``needs_last_ts``).
        """

    def emitted_reference(self, window: WindowSpec, ts: str = "ts") -> pl.Expr:
        """Polars over one (window, key) group's raw rows and ``start``: ``emitted``'s twin."""

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
    """Windows aligned to the epoch, one starting every ``slide_ms`` (tumbling, hopping, sliding).

    ``triggered``: a window is a result for a key only if the key has a row in its last slide
    (the sliding kind; see the module docstring).
    """

    name: str
    takes_slide: bool
    slide_key: str = "slide_ms"
    triggered: bool = False

    @property
    def needs_last_ts(self) -> bool:
        """Triggered windows read each state's latest event time."""
        return self.triggered

    def emitted(
        self, start: Int64Array, last_ts: Int64Array | None, window: WindowSpec
    ) -> npt.NDArray[np.bool_] | None:
        """Triggered: whether the latest row lies in the window's last slide; else None."""
        if not self.triggered:
            return None
        assert last_ts is not None, "the plan carries last_ts for triggered windows"
        result: npt.NDArray[np.bool_] = last_ts >= start + (window.size_ms - window.slide_ms)
        return result

    def emitted_reference(self, window: WindowSpec, ts: str = "ts") -> pl.Expr:
        """Polars: the group's latest row lies in the window's last slide (or always)."""
        if not self.triggered:
            return pl.lit(value=True)
        return pl.col(ts).max() >= pl.col("start").first() + (window.size_ms - window.slide_ms)

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
        """Each row's pane of ``slide_ms``, one membership per row (``fan`` = size/slide).

        Slot ``k`` is the window starting at ``(first + k) * slide_ms``; pane slot ``p`` lies
        in window slots ``p .. p + fan - 1``.
        """
        fan = window.windows_per_row
        pane = ts // window.slide_ms  # the newest window of each row, in slides since 0
        lowest = int(pane.min())
        first = lowest - (fan - 1)
        return Assignment(1, pane - lowest, first * window.slide_ms, window.slide_ms, fan)


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
    slide_key: str = "slide_ms"
    needs_last_ts: bool = False

    def emitted(
        self, start: Int64Array, last_ts: Int64Array | None, window: WindowSpec
    ) -> npt.NDArray[np.bool_] | None:
        """Every count window with rows is a result."""
        del start, last_ts, window
        return None

    def emitted_reference(self, window: WindowSpec, ts: str = "ts") -> pl.Expr:
        """Every count window with rows is a result."""
        del window, ts
        return pl.lit(value=True)

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
SLIDING: Final = AlignedWindows("sliding", takes_slide=True, slide_key="step_ms", triggered=True)
COUNT: Final = CountWindows()

WINDOW_KINDS: Final[dict[str, WindowKind]] = {
    k.name: k for k in (TUMBLING, HOPPING, SLIDING, COUNT)
}
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
