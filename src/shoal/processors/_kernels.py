"""Numpy machinery for the hot paths: runs of equal group ids, and sketch cells.

Per-batch partial state and merging state are one sort and ``reduceat`` passes, several times
faster than per-group expression evaluation for the many small groups of a sensor batch. The
per-field arithmetic is not here: every state field in the registry (``aggregates.py``) brings
its own kernels, and ``partial_state``/``merge_state`` sort once and call them in turn. The
sketch's cell kernels (``merge_cells``, ``quantile_buckets``, ...) are the quantile family's.

Rows are grouped by an int64 *group id*; every kernel returns groups in ascending id order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

BUCKET_BITS: Final = 24
"""Bits of a sketch cell id that hold the bucket key (offset to be non-negative)."""
_BUCKET_OFFSET: Final = 1 << (BUCKET_BITS - 1)


@dataclass(frozen=True, slots=True)
class Runs:
    """Rows sorted by group: group ``i`` is the run ``starts[i] : starts[i] + lengths[i]``.

    Attributes:
        starts: first row of each group (ascending; no group is empty).
        lengths: rows per group.
        columns: the sorted input columns: ``ts`` and ``value`` for a partial, the state
            columns for a merge.
        done: fields already computed for these groups (a kernel reads its dependencies here).
    """

    starts: Int64Array
    lengths: Int64Array
    columns: Mapping[str, npt.NDArray[Any]]
    done: Mapping[str, npt.NDArray[Any]]
    _increasing: dict[str, bool] = dataclass_field(default_factory=dict)
    _longest: list[int] = dataclass_field(default_factory=list)  # the longest run, once known

    def edge(self, column: str, ufunc: np.ufunc) -> npt.NDArray[Any]:
        """Each group's first row of ``column`` (``np.minimum``) or its last (otherwise).

        Its smallest or largest value when ``increasing(column)``.
        """
        rows = self.starts if ufunc is np.minimum else self.starts + self.lengths - 1
        edge: npt.NDArray[Any] = self.columns[column][rows]
        return edge

    def increasing(self, column: str) -> bool:
        """Whether ``column`` strictly increases within every group (remembered per column).

        Rows of a sensor usually arrive in time order: then a group's earliest and latest
        event times are its first and last rows, with no ties, and the first/last kernels
        take them by index instead of a ``reduceat`` each (same values, bit for bit).
        """
        known = self._increasing.get(column)
        if known is None:
            values = self.columns[column]
            rising = values[1:] > values[:-1]
            rising[self.starts[1:] - 1] = True  # a group boundary: no order across groups
            known = self._increasing[column] = bool(rising.all())
        return known

    def reduce(self, ufunc: np.ufunc, column: str | npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``ufunc`` over each group's run of ``column`` (a name in ``columns``, or an array)."""
        values = self.columns[column] if isinstance(column, str) else column
        longest = self._longest
        if not longest:
            longest.append(int(self.lengths.max()) if len(self.lengths) else 0)
        return reduce_runs(ufunc, values, self.starts, self.lengths, longest[0])

    def spread(self, per_group: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A per-group array repeated over each group's rows."""
        return np.repeat(per_group, self.lengths)


class FieldKernels(Protocol):
    """What ``partial_state`` and ``merge_state`` need of a state field."""

    @property
    def name(self) -> str:
        """The state column."""

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """Its numpy dtype."""

    def partial_np(self, runs: Runs) -> npt.NDArray[Any]:
        """Its value per group from raw rows (``ts``, ``value``)."""

    def merge_np(self, runs: Runs) -> npt.NDArray[Any]:
        """Its value per group from state rows."""


def run_bounds(sorted_ids: npt.NDArray[np.integer[Any]]) -> tuple[Int64Array, Int64Array]:
    """Start index and length of each run of equal ids (``gather_runs`` is its inverse)."""
    n = len(sorted_ids)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    change = np.empty(n, dtype=bool)  # written in place: no shifted copies, no concatenation
    change[0] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=change[1:])
    starts = np.flatnonzero(change).astype(np.int64, copy=False)
    lengths = np.empty(len(starts), dtype=np.int64)  # ``np.diff(append=)`` costs ~8 us more
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    lengths[-1] = n - starts[-1]
    return starts, lengths


_SAME_DTYPE_FOLDS: Final = (np.dtype(np.int64), np.dtype(np.float64))
"""Dtypes that ``reduceat`` keeps (it widens smaller integers and booleans for ``add``)."""


def reduce_runs(
    ufunc: np.ufunc,
    values: npt.NDArray[Any],
    starts: Int64Array,
    lengths: Int64Array,
    longest: int,
) -> npt.NDArray[Any]:
    """``ufunc.reduceat(values, starts)`` for runs that cover ``values``.

    ``longest``: the longest run's length. Two shapes are folded element by element instead,
    several times faster than ``reduceat``'s loop per group, with the same values, bit for bit
    (for the dtypes ``reduceat`` does not widen):

    * runs of at most two rows (two merged runs of unique groups: a sliding window's
      two-stack merges, a pane's first merge): a run of two is ``ufunc(first, second)``, the
      very operation ``reduceat`` does;
    * runs all of the same length, at most ``FOLDED_RUN_ROWS`` (a sensor batch: every key a
      few rows), folded one row position at a time (``_fold_equal_runs``).
    """
    foldable = len(starts) > 0 and values.dtype in _SAME_DTYPE_FOLDS
    if foldable and longest == 1:
        return values.copy()
    if foldable and 1 < longest <= FOLDED_RUN_ROWS and len(values) == longest * len(starts):
        return _fold_equal_runs(ufunc, values, longest)  # every run ``longest`` rows
    if not foldable or longest > 2:
        result: npt.NDArray[Any] = ufunc.reduceat(values, starts)
        return result
    out: npt.NDArray[Any] = values[starts]
    two = np.flatnonzero(lengths == 2)
    out[two] = ufunc(out[two], values[starts[two] + 1])
    return out


FOLDED_RUN_ROWS: Final = 8
"""Longest runs of equal length that ``reduce_runs`` folds by row position: ``reduceat`` adds
the rest of a longer run pairwise, in another order."""


def _fold_equal_runs(ufunc: np.ufunc, values: npt.NDArray[Any], length: int) -> npt.NDArray[Any]:
    """``ufunc.reduceat`` over consecutive runs of ``length`` rows each (2 <= length <= 8).

    ``reduceat`` starts from a run's first row and folds the others into it in order, but a
    float sum adds the others up first (from -0.0, which changes nothing) and then adds them
    to the first row; the folds here do the same operations in the same order.
    """
    at: list[npt.NDArray[Any]] = [values[k::length] for k in range(length)]
    if ufunc is np.add and length > 2:
        rest = at[1] + at[2]
        for column in at[3:]:
            np.add(rest, column, out=rest)
        at = [at[0], rest]
    out: npt.NDArray[Any] = ufunc(at[0], at[1])
    for column in at[2:]:
        ufunc(out, column, out=out)
    return out


def gather_runs(starts: Int64Array, lengths: Int64Array) -> Int64Array:
    """Indices ``starts[i] .. starts[i] + lengths[i] - 1`` for every ``i``, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    offsets = np.repeat(starts - (ends - lengths), lengths)
    return offsets + np.arange(total, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class GroupSort:
    """A batch's rows in group order: what ``partial_state`` computes before its kernels.

    Attributes:
        groups: the group id of each row, as given.
        order: a stable order that makes equal ids adjacent (None: they already are).
        starts: first row of each group in that order.
        lengths: rows per group.
        unique: the group ids, ascending.

    A ``GroupSorter`` hands the same ones to later batches, ``frozen``.
    """

    groups: Int64Array
    order: Int64Array | None
    starts: Int64Array
    lengths: Int64Array
    unique: Int64Array

    @classmethod
    def of(cls, groups: Int64Array) -> GroupSort:
        """Sort ``groups`` (one stable radix sort when the ids are small)."""
        order = None if _ascending(groups) else _group_order(groups)
        g = groups if order is None else groups[order]
        starts, lengths = run_bounds(g)
        unique = g[starts] if len(starts) else g[:0]
        return cls(groups, order, starts, lengths, unique)

    def frozen(self) -> GroupSort:
        """These arrays, read-only (copies where they are views of the caller's ids)."""
        return GroupSort(
            _read_only(self.groups),
            None if self.order is None else _read_only(self.order),
            _read_only(self.starts),
            _read_only(self.lengths),
            _read_only(self.unique),
        )


def _read_only(array: Int64Array) -> Int64Array:
    """``array``, or a copy of it if it is a view, made read-only."""
    owned = array if array.base is None else array.copy()
    owned.flags.writeable = False
    return owned


class GroupSorter:
    """Remembers the last batch's ``GroupSort`` and reuses it for equal group ids.

    A gateway that reads its sensors in a fixed order sends the same keys in the same order
    batch after batch (scenario A: 1,000 sensors, 4 rows each): the sort, its gathers and the
    run bounds (~30 us of a 4,000-row batch) then cost one comparison of the ids. Safe to share
    between threads: the memo is one immutable object, replaced whole.
    """

    def __init__(self) -> None:
        self._last: GroupSort | None = None

    def sort(self, groups: Int64Array) -> GroupSort:
        """``GroupSort.of(groups)``, or the last one when its ids equal ``groups``."""
        last = self._last
        if last is not None and np.array_equal(last.groups, groups):
            return last
        self._last = found = GroupSort.of(groups.copy()).frozen()
        return found


def partial_state(
    groups: Int64Array,
    ts: Int64Array,
    value: FloatArray,
    fields: Sequence[FieldKernels],
    bucket: Int64Array | None = None,
    *,
    sorter: GroupSorter | None = None,
    sort: GroupSort | None = None,
) -> tuple[
    Int64Array, dict[str, npt.NDArray[Any]], tuple[Int64Array, Int64Array, Int64Array] | None
]:
    """State of every group of one batch.

    Args:
        groups: group id per row.
        ts: event time per row.
        value: value per row.
        fields: state fields to compute, each after the fields it needs
            (``AggregatePlan.fields``).
        bucket: sketch bucket key per row, or None for no sketch.
        sorter: remembers the sort of earlier batches (None: sort these rows).
        sort: the rows' ``GroupSort``, known already (a count window's close step numbers
            its rows into groups itself); ``sorter`` is not asked then.

    Returns:
        (group ids ascending, field arrays aligned with them, sketch) where sketch is
        (group index into the first array, bucket key, count) per non-empty bucket, or None.
        The group ids may be read-only (shared with later batches through ``sorter``).
    """
    if sort is None:
        sort = GroupSort.of(groups) if sorter is None else sorter.sort(groups)
    order, starts, lengths, unique = sort.order, sort.starts, sort.lengths, sort.unique
    out: dict[str, npt.NDArray[Any]] = {}
    if len(starts) == 0:
        out = {f.name: np.zeros(0, dtype=f.np_dtype) for f in fields}
    else:
        columns = (
            {"ts": ts, "value": value}
            if order is None
            else {"ts": ts[order], "value": value[order]}
        )
        runs = Runs(starts, lengths, columns, out)
        for field in fields:
            out[field.name] = field.partial_np(runs)
    sketch = None
    if bucket is not None:
        sketch = _bucket_counts(unique, groups, bucket, order, lengths)
    return unique, out, sketch


SPARSE_CELLS_PER_ROW: Final = 4
"""A batch's (group, bucket) grid larger than this many cells per row is counted by sorting."""
_INT32_TOP: Final = (1 << 31) - 1


def _ascending(groups: Int64Array) -> bool:
    """Whether ``groups`` never decreases (count windows' close steps: rows sorted by key)."""
    return len(groups) < 2 or bool((groups[1:] >= groups[:-1]).all())


def _group_order(groups: Int64Array) -> Int64Array:
    """A stable order that makes equal group ids adjacent.

    Small non-negative ids (the usual case: window slots times batch-local key codes) are
    sorted as 16-bit integers, which numpy does with a radix sort in linear time.
    """
    if len(groups) and groups.min() >= 0 and groups.max() < 1 << 16:
        order: Int64Array = np.argsort(groups.astype(np.uint16), kind="stable")
    else:
        order = np.argsort(groups, kind="stable")
    return order


def _bucket_counts(
    unique_groups: Int64Array,
    groups: Int64Array,
    bucket: Int64Array,
    order: Int64Array | None,
    lengths: Int64Array,
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """(index into ``unique_groups``, bucket key, count) per non-empty (group, bucket).

    ``order`` and ``lengths``: the rows in group order (None: they are in it) and the rows
    per group (``partial_state``'s sort). Counted with ``bincount`` over a dense (group, bucket)
    grid when the grid is not much larger than the batch; otherwise (many keys with a few
    rows each, the usual sensor batch: 1,000 keys x 57 buckets for 4,000 rows) by sorting
    the rows' cell numbers, which touches only the rows. Either way ordered by group, then
    bucket.
    """
    low = int(bucket.min())
    width = int(bucket.max()) - low + 1
    if len(unique_groups) * width > SPARSE_CELLS_PER_ROW * len(groups):
        index_of_row = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        in_order = bucket if order is None else bucket[order]
        numbers = index_of_row * width + (in_order - low)
        if len(lengths) * width <= _INT32_TOP:  # a sort of 32-bit integers takes half the time
            numbers = numbers.astype(np.int32)
        numbers.sort()
        starts, counts = run_bounds(numbers)
        first = numbers[starts].astype(np.int64, copy=False)
        group = first // width  # one division: integer division is the slow part
        return group, first - group * width + low, counts
    if len(unique_groups) and unique_groups[0] == 0 and unique_groups[-1] == len(lengths) - 1:
        group_index = groups  # the groups are numbered 0, 1, ... already (count windows)
    elif len(unique_groups) and unique_groups[0] >= 0 and unique_groups[-1] < 1 << 22:
        lookup = np.empty(int(unique_groups[-1]) + 1, dtype=np.int64)
        lookup[unique_groups] = np.arange(len(unique_groups))
        group_index = lookup[groups]
    else:
        group_index = np.searchsorted(unique_groups, groups)
    cells = len(unique_groups) * width
    if cells <= 1 << 22:
        numbers = group_index * width
        numbers += bucket
        numbers -= low
        counts = np.bincount(numbers, minlength=cells)
        filled = np.flatnonzero(counts > 0)  # a bool mask: 4x faster than int64's nonzero
        group, offset = np.divmod(filled, width)  # one division for both
        offset += low
        return group, offset, counts[filled].astype(np.int64, copy=False)
    merged, totals = merge_cells(cell_ids(group_index, bucket), np.ones(len(groups), np.int64))
    return cell_groups(merged), cell_buckets(merged), totals


def merge_state(
    groups: Int64Array, columns: Mapping[str, npt.NDArray[Any]], fields: Sequence[FieldKernels]
) -> tuple[Int64Array, dict[str, npt.NDArray[Any]]]:
    """Merge state rows that share a group id (``fields`` as for ``partial_state``)."""
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts, lengths = run_bounds(g)
    if len(starts) == 0:
        return g, {f.name: columns[f.name][:0] for f in fields}
    out: dict[str, npt.NDArray[Any]] = {}
    runs = Runs(starts, lengths, {f.name: columns[f.name][order] for f in fields}, out)
    for field in fields:
        out[field.name] = field.merge_np(runs)
    return g[starts], out


def merge_pair(
    keys: Int64Array,
    columns: Mapping[str, npt.NDArray[Any]],
    later_keys: Int64Array,
    later_columns: Mapping[str, npt.NDArray[Any]],
    fields: Sequence[FieldKernels],
) -> tuple[Int64Array, dict[str, npt.NDArray[Any]]]:
    """``merge_state`` of two states with ascending, unique keys, the ``later`` one second.

    When both hold the same keys (a sliding window's panes over sensors that report every
    step), the sorted rows are the two states' rows interleaved, every group two rows: no
    sort, no gathers, and the fields fold element by element (``reduce_runs``). The same
    arrays as ``merge_state`` of the concatenation, bit for bit.
    """
    if not np.array_equal(keys, later_keys):
        return merge_state(
            np.concatenate((keys, later_keys)),
            {f.name: np.concatenate((columns[f.name], later_columns[f.name])) for f in fields},
            fields,
        )
    n = len(keys)
    if n == 0:
        return keys, {f.name: columns[f.name][:0] for f in fields}
    both = {f.name: _interleaved(columns[f.name], later_columns[f.name]) for f in fields}
    starts = np.arange(0, 2 * n, 2, dtype=np.int64)
    out: dict[str, npt.NDArray[Any]] = {}
    runs = Runs(starts, np.full(n, 2, dtype=np.int64), both, out, _longest=[2])
    for field in fields:
        out[field.name] = field.merge_np(runs)
    return keys.copy(), out


def _interleaved(first: npt.NDArray[Any], second: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``first[0], second[0], first[1], second[1], ...``."""
    out = np.empty(2 * len(first), dtype=np.result_type(first, second))
    out[0::2] = first
    out[1::2] = second
    return out


def merge_sorted_cells(
    cells: Int64Array, counts: Int64Array, later_cells: Int64Array, later_counts: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """``merge_cells`` of two sorted, unique sets of cells: equal cells are adjacent pairs.

    One stable sort of the two runs, then each pair folded into its first cell and the
    second ones left out (no run bounds, no ``reduceat``; ``take`` of the kept positions,
    which is several times faster than a boolean mask). Counts are integers: the sums are
    exact, the same as ``merge_cells``'.
    """
    if len(cells) == 0 or len(later_cells) == 0:
        if len(cells) == 0:
            return later_cells, later_counts
        return cells, counts
    both = np.concatenate((cells, later_cells))
    order = np.argsort(both, kind="stable")  # timsort: one merge of two sorted runs
    merged, summed = both[order], np.concatenate((counts, later_counts))[order]
    second = np.empty(len(merged), dtype=bool)  # the second cell of an equal pair
    second[0] = False
    np.equal(merged[1:], merged[:-1], out=second[1:])
    summed[:-1] += summed[1:] * second[1:]
    kept = np.flatnonzero(~second)
    if len(kept) == len(merged):
        return merged, summed
    return merged.take(kept), summed.take(kept)


def merge_cells(cells: Int64Array, counts: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Sum counts of equal cell ids; returns sorted unique cells and their counts.

    One stable sort (timsort: linear on the concatenated sorted runs a combiner merges, each
    partial's cells and a merged base being sorted already), then one ``reduceat``. A dense
    (slot, key, bucket) grid counted with ``bincount`` was tried here: faster only on cells
    in no order, and on a combiner's cells twice as slow and 2-4 times the memory (the grid
    is slots x keys x bucket width, mostly empty; a 47 MB step of a restored combiner's
    peak in ``shoal bench chaos``; docs/benchmarks.md, "The combiner's sketch cells merged
    by sorting and inserting").
    """
    order = np.argsort(cells, kind="stable")
    c = cells[order]
    starts, lengths = run_bounds(c)
    if len(starts) == 0:
        return c, counts[:0]
    longest = int(lengths.max())
    return c[starts], reduce_runs(np.add, counts[order], starts, lengths, longest)


def add_cells(
    cells: Int64Array, counts: Int64Array, new_cells: Int64Array, new_counts: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """Merge cells into a sorted, unique set: sorted inserts, no re-sort of the set.

    The new cells are merged among themselves (``merge_cells``), then each is added to its
    equal in the set or inserted at its place: time and memory about the set's size plus the
    new cells', fewer or more of them alike. An empty set gives the new cells merged.
    """
    extra, extra_counts = merge_cells(new_cells, new_counts)
    if len(cells) == 0:
        return extra, extra_counts
    at = np.searchsorted(cells, extra)
    found = at < len(cells)
    found[found] = cells[at[found]] == extra[found]
    counts = counts.copy()
    counts[at[found]] += extra_counts[found]
    missing = ~found
    return (
        np.insert(cells, at[missing], extra[missing]),
        np.insert(counts, at[missing], extra_counts[missing]),
    )


def cell_ids(groups: Int64Array, buckets: Int64Array) -> Int64Array:
    """Sketch cell ids: the group in the high bits, the bucket key in the low ``BUCKET_BITS``."""
    return (groups << BUCKET_BITS) | (buckets + _BUCKET_OFFSET)


def cell_groups(cells: Int64Array) -> Int64Array:
    """The group id of each cell."""
    return cells >> BUCKET_BITS


def cell_buckets(cells: Int64Array) -> Int64Array:
    """The bucket key of each cell."""
    return (cells & ((1 << BUCKET_BITS) - 1)) - _BUCKET_OFFSET


def _group_cells(cells: Int64Array, groups: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Each group's first cell and the cell after its last (cells sorted)."""
    owner = cells >> BUCKET_BITS
    starts, lengths = run_bounds(owner)
    if len(starts) == len(groups) and np.array_equal(owner[starts], groups):
        # The usual case, cells for exactly these groups: their runs, without two binary
        # searches per group over every cell.
        return starts, starts + lengths
    # A group's cells are the run of ids from ``group << BUCKET_BITS`` up to the next group's.
    first = np.searchsorted(cells, groups << BUCKET_BITS, side="left")
    last = np.searchsorted(cells, (groups + 1) << BUCKET_BITS, side="left")
    return first, last


def quantile_buckets(
    cells: Int64Array, counts: Int64Array, groups: Int64Array, quantiles: Sequence[float]
) -> list[Int64Array]:
    """Bucket key holding each quantile of each group (cells sorted; every group present).

    The ``q`` quantile of ``n`` values is the ``floor(q * (n - 1))``-th smallest (0-based).
    """
    cum = np.cumsum(counts)
    first, last = _group_cells(cells, groups)
    before = np.where(first > 0, cum[np.maximum(first - 1, 0)], 0)
    totals = cum[last - 1] - before
    out = []
    for q in quantiles:
        rank = np.floor((totals - 1) * q).astype(np.int64)
        index = np.searchsorted(cum, before + rank, side="right")
        out.append(cell_buckets(cells[index]))
    return out
