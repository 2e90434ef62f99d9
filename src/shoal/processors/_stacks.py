"""Two-stack assembly of pane windows: each window from a suffix and a prefix of pane blocks.

A sliding window of ``fan = size/step`` panes is the merge of ``fan`` consecutive pane states.
Merging all of them at every step merges every pane ``fan`` times. Instead, panes are grouped
in aligned *blocks* of ``fan`` (pane index ``i`` is in block ``i // fan``), and the window
whose first pane is ``a`` (last pane ``a + fan - 1``) is

* the whole block ``a // fan`` when ``a`` starts a block, else
* the *suffix* of block ``a // fan`` from pane ``a`` merged with the *prefix* of the next
  block through pane ``a + fan - 1``.

A block's suffixes are computed together, once, from its last pane down (one two-way merge
per pane), and a block's prefix grows by one two-way merge per step, so a step costs about
three two-way merges instead of one ``fan``-way merge (Tangwongsan et al., "two stacks";
Flink's pane sharing). Which panes are merged in which order depends only on the window's
first pane, never on what was cached, so a result is a pure function of the pane states (the
same after a restart, when the stacks are rebuilt). Against the ``fan``-way merge only float
rounding of sums and M2 differs: the freedom every merge takes.

A stack remembers the *version* of each pane it holds (``WindowState`` counts every change
of a pane); a pane that changed since (a row for an older pane from a gateway behind the
others) makes the stacks holding it stale, and they are computed again.

``continued`` (``PANE_CONTINUED``) is kept from the earliest pane of a run only: a window's
``batches`` is its panes' sum plus its first pane's ``continued``.

Imports only ``_kernels`` and ``aggregates``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shoal.processors._kernels import FieldKernels, merge_pair, merge_sorted_cells
from shoal.processors.aggregates import PANE_CONTINUED

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Keyed:
    """Merged state of a run of consecutive panes of one window spec, per key.

    ``keys``: key ids, ascending and unique; ``columns``: the pane plan's fields aligned with
    them; ``cells``: sketch cells ``key << BUCKET_BITS | bucket``, ascending and unique, with
    their ``counts``.
    """

    keys: Int64Array
    columns: dict[str, npt.NDArray[Any]]
    cells: Int64Array
    counts: Int64Array


def combine(earlier: Keyed, later: Keyed, fields: Sequence[FieldKernels]) -> Keyed:
    """The merge of two adjacent runs of panes (``earlier``'s first): one two-way merge.

    Each input is sorted and unique: the keys merge as two runs (``merge_pair``: no sort at
    all when both hold the same keys), and so do the sketch cells (``merge_sorted_cells``).
    """
    later_columns = later.columns
    if PANE_CONTINUED.name in later_columns:  # only the first pane's counts
        continued = later_columns[PANE_CONTINUED.name]
        later_columns = {**later_columns, PANE_CONTINUED.name: np.zeros_like(continued)}
    keys, merged = merge_pair(earlier.keys, earlier.columns, later.keys, later_columns, fields)
    cells, counts = merge_sorted_cells(earlier.cells, earlier.counts, later.cells, later.counts)
    return Keyed(keys, merged, cells, counts)


def _owned(pane: Keyed | None) -> Keyed | None:
    """A copy of a pane that a stack holds alone.

    A pane is a view of the pane state's arrays, which a stored stack must not keep alive.
    """
    if pane is None:
        return None
    columns = {f: c.copy() for f, c in pane.columns.items()}
    return Keyed(pane.keys.copy(), columns, pane.cells.copy(), pane.counts.copy())


PaneLookup = Callable[[int], tuple[int, Keyed | None]]
"""Pane index -> (its version, its state; None: no rows). Version 0: not held."""


@dataclass(slots=True)
class _Prefix:
    versions: list[int]  # of panes block start .. through
    state: Keyed | None


@dataclass(slots=True)
class _Suffixes:
    versions: list[int]  # of every pane of the block
    states: list[Keyed | None]  # index i: the block's panes i .. fan - 1 (i >= 1)


class PaneStacks:
    """Prefixes and suffixes of pane blocks, per window spec; derived state, never saved."""

    def __init__(self, fields: Sequence[FieldKernels]) -> None:
        self._fields = fields
        self._prefixes: dict[tuple[int, int], _Prefix] = {}
        self._suffixes: dict[tuple[int, int], _Suffixes] = {}
        self.merges = 0
        """Two-way merges done (for tests and benchmarks)."""

    def clear(self) -> None:
        """Forget every stack (the pane state was replaced)."""
        self._prefixes.clear()
        self._suffixes.clear()

    def window(self, window: int, first: int, fan: int, pane: PaneLookup) -> Keyed | None:
        """The merged state of ``window``'s panes ``first .. first + fan - 1`` (None: no rows)."""
        block = first // fan
        if first % fan == 0:
            return self._prefix(window, block, fan, first + fan - 1, pane)
        suffix = self._suffix(window, block, fan, first, pane)
        prefix = self._prefix(window, block + 1, fan, first + fan - 1, pane)
        if suffix is None or prefix is None:
            return prefix if suffix is None else suffix
        self.merges += 1
        return combine(suffix, prefix, self._fields)

    def _join(self, earlier: Keyed | None, later: Keyed | None) -> Keyed | None:
        if earlier is None or later is None:
            return later if earlier is None else earlier
        self.merges += 1
        return combine(earlier, later, self._fields)

    def _prefix(
        self, window: int, block: int, fan: int, through: int, pane: PaneLookup
    ) -> Keyed | None:
        """Panes ``block * fan .. through`` merged, extending the stored prefix if valid."""
        lo = block * fan
        looked = [pane(i) for i in range(lo, through + 1)]
        versions = [v for v, _ in looked]
        stored = self._prefixes.get((window, block))
        if stored is not None and versions[: len(stored.versions)] == stored.versions:
            state, done = stored.state, len(stored.versions)
        else:
            state, done = None, 0
        for _, part in looked[done:]:
            state = self._join(state, _owned(part) if state is None else part)
        if stored is None or len(versions) >= len(stored.versions):
            self._prefixes[(window, block)] = _Prefix(versions, state)
        return state

    def _suffix(
        self, window: int, block: int, fan: int, first: int, pane: PaneLookup
    ) -> Keyed | None:
        """Panes ``first .. (block + 1) * fan - 1`` merged (all the block's suffixes at once)."""
        lo = block * fan
        looked = [pane(i) for i in range(lo, lo + fan)]
        versions = [v for v, _ in looked]
        at = first - lo
        stored = self._suffixes.get((window, block))
        if stored is None or stored.versions[at:] != versions[at:]:
            states: list[Keyed | None] = [None] * fan
            state: Keyed | None = None
            for i in range(fan - 1, 0, -1):
                part = looked[i][1]
                state = self._join(_owned(part) if state is None else part, state)
                states[i] = state
            stored = _Suffixes(versions, states)
            self._suffixes[(window, block)] = stored
        return stored.states[at]

    def prune(self, window: int, fan: int, oldest_first: int | None) -> None:
        """Forget ``window``'s stacks that no held window needs.

        ``oldest_first``: the first pane of the oldest window still held (None: none held).
        Block ``b``'s prefixes serve the windows whose first pane is at most ``b * fan``, its
        suffixes those whose first pane is in the block.
        """
        for table, reach in ((self._prefixes, 1), (self._suffixes, fan)):
            stale = [
                (w, block)
                for w, block in table
                if w == window and (oldest_first is None or block * fan + reach <= oldest_first)
            ]
            for key in stale:
                del table[key]
