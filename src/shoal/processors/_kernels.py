"""Numpy kernels for the hot paths: per-batch partial state and merging state.

They compute exactly what the polars expressions in ``aggregates.py`` define (those stay the
readable reference; ``tests/unit/processors/test_kernels.py`` checks the two agree), but with
one sort and ``reduceat`` calls instead of per-group expression evaluation, which is several
times faster for the many small groups of a sensor batch.

Rows are grouped by an int64 *group id*; every kernel returns groups in ascending id order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

BUCKET_BITS: Final = 24
"""Bits of a sketch cell id that hold the bucket key (offset to be non-negative)."""
_BUCKET_OFFSET: Final = 1 << (BUCKET_BITS - 1)


def _boundaries(sorted_ids: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Start index and length of each run of equal ids."""
    if len(sorted_ids) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    change = np.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1
    starts = np.concatenate(([0], change)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [len(sorted_ids)]))).astype(np.int64)
    return starts, lengths


def partial_state(
    groups: Int64Array,
    ts: Int64Array,
    value: FloatArray,
    fields: Sequence[str],
    bucket: Int64Array | None = None,
) -> tuple[
    Int64Array, dict[str, npt.NDArray[Any]], tuple[Int64Array, Int64Array, Int64Array] | None
]:
    """State of every group of one batch.

    Args:
        groups: group id per row.
        ts: event time per row.
        value: value per row.
        fields: state fields to compute (names from ``aggregates.STATE_FIELDS``).
        bucket: sketch bucket key per row, or None for no sketch.

    Returns:
        (group ids ascending, field arrays aligned with them, sketch) where sketch is
        (group index into the first array, bucket key, count) per non-empty bucket, or None.
    """
    order = _group_order(groups)
    g = groups[order]
    v = value[order]
    t = ts[order]
    starts, lengths = _boundaries(g)
    out: dict[str, npt.NDArray[Any]] = {}
    n = lengths
    if "n" in fields:
        out["n"] = n
    if "batches" in fields:
        out["batches"] = np.ones(len(starts), dtype=np.int64)
    sums = np.add.reduceat(v, starts) if len(starts) else np.zeros(0)
    if "sum" in fields:
        out["sum"] = sums
    if "min" in fields:
        out["min"] = np.minimum.reduceat(v, starts) if len(starts) else np.zeros(0)
    if "max" in fields:
        out["max"] = np.maximum.reduceat(v, starts) if len(starts) else np.zeros(0)
    if "m2" in fields:
        mean = np.repeat(sums / np.maximum(n, 1), n)
        out["m2"] = np.add.reduceat((v - mean) ** 2, starts) if len(starts) else np.zeros(0)
    if "first_ts" in fields:
        first_ts = np.minimum.reduceat(t, starts) if len(starts) else np.zeros(0, np.int64)
        out["first_ts"] = first_ts
        at_first = t == np.repeat(first_ts, n)
        out["first_value"] = (
            np.minimum.reduceat(np.where(at_first, v, np.inf), starts)
            if len(starts)
            else np.zeros(0)
        )
    if "last_ts" in fields:
        last_ts = np.maximum.reduceat(t, starts) if len(starts) else np.zeros(0, np.int64)
        out["last_ts"] = last_ts
        at_last = t == np.repeat(last_ts, n)
        out["last_value"] = (
            np.maximum.reduceat(np.where(at_last, v, -np.inf), starts)
            if len(starts)
            else np.zeros(0)
        )
    sketch = None
    if bucket is not None:
        sketch = _bucket_counts(g[starts] if len(starts) else g[:0], groups, bucket)
    return g[starts] if len(starts) else g[:0], out, sketch


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
    unique_groups: Int64Array, groups: Int64Array, bucket: Int64Array
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """(index into ``unique_groups``, bucket key, count) per non-empty (group, bucket).

    Counted with ``bincount`` over a dense (group, bucket) grid when it is small enough,
    which needs no sort; otherwise by sorting cell ids. Either way ordered by group, then
    bucket.
    """
    low = int(bucket.min())
    width = int(bucket.max()) - low + 1
    if len(unique_groups) and unique_groups[0] >= 0 and unique_groups[-1] < 1 << 22:
        lookup = np.empty(int(unique_groups[-1]) + 1, dtype=np.int64)
        lookup[unique_groups] = np.arange(len(unique_groups))
        group_index = lookup[groups]
    else:
        group_index = np.searchsorted(unique_groups, groups)
    cells = len(unique_groups) * width
    if cells <= 1 << 22:
        counts = np.bincount(group_index * width + (bucket - low), minlength=cells)
        filled = np.flatnonzero(counts)
        return filled // width, filled % width + low, counts[filled].astype(np.int64)
    merged, totals = merge_cells(cell_ids(group_index, bucket), np.ones(len(groups), np.int64))
    return cell_groups(merged), cell_buckets(merged), totals


def merge_state(
    groups: Int64Array, columns: dict[str, npt.NDArray[Any]]
) -> tuple[Int64Array, dict[str, npt.NDArray[Any]]]:
    """Merge state rows that share a group id (the numpy twin of the polars merge exprs)."""
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts, lengths = _boundaries(g)
    if len(starts) == 0:
        return g, {k: v[:0] for k, v in columns.items()}
    col = {k: v[order] for k, v in columns.items()}
    out: dict[str, npt.NDArray[Any]] = {}
    n = np.add.reduceat(col["n"], starts) if "n" in col else None
    for name in ("n", "batches", "sum"):
        if name in col:
            out[name] = np.add.reduceat(col[name], starts)
    if "min" in col:
        out["min"] = np.minimum.reduceat(col["min"], starts)
    if "max" in col:
        out["max"] = np.maximum.reduceat(col["max"], starts)
    if "m2" in col:
        assert n is not None
        total_mean = np.repeat(out["sum"] / n, lengths)
        part_mean = col["sum"] / col["n"]
        spread = col["n"] * (part_mean - total_mean) ** 2
        out["m2"] = np.add.reduceat(col["m2"] + spread, starts)
    if "first_ts" in col:
        first_ts = np.minimum.reduceat(col["first_ts"], starts)
        at = col["first_ts"] == np.repeat(first_ts, lengths)
        out["first_ts"] = first_ts
        out["first_value"] = np.minimum.reduceat(np.where(at, col["first_value"], np.inf), starts)
    if "last_ts" in col:
        last_ts = np.maximum.reduceat(col["last_ts"], starts)
        at = col["last_ts"] == np.repeat(last_ts, lengths)
        out["last_ts"] = last_ts
        out["last_value"] = np.maximum.reduceat(np.where(at, col["last_value"], -np.inf), starts)
    return g[starts], out


DENSE_GRID_LIMIT: Final = 1 << 24
"""Largest (group, bucket) grid counted with ``bincount`` instead of a sort (128 MiB)."""


def merge_cells(
    cells: Int64Array, counts: Int64Array, key_bits: int | None = None
) -> tuple[Int64Array, Int64Array]:
    """Sum counts of equal cell ids; returns sorted unique cells and their counts.

    With ``key_bits`` (a group is ``slot << key_bits | key``, both dense), the cells are
    counted on a dense (slot, key, bucket) grid with one ``bincount``: linear time, no sort.
    Sparse or huge grids fall back to sorting.
    """
    if key_bits is not None and len(cells):
        dense = _merge_cells_dense(cells, counts, key_bits)
        if dense is not None:
            return dense
    order = np.argsort(cells, kind="stable")  # timsort: fast on concatenated sorted runs
    c = cells[order]
    starts, _ = _boundaries(c)
    if len(starts) == 0:
        return c, counts[:0]
    return c[starts], np.add.reduceat(counts[order], starts)


def add_cells(
    cells: Int64Array, counts: Int64Array, new_cells: Int64Array, new_counts: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """Merge a few cells into a large sorted, unique set: sorted inserts, no full re-sort."""
    extra, extra_counts = merge_cells(new_cells, new_counts)
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


def _merge_cells_dense(
    cells: Int64Array, counts: Int64Array, key_bits: int
) -> tuple[Int64Array, Int64Array] | None:
    bucket = cells & ((1 << BUCKET_BITS) - 1)
    group = cells >> BUCKET_BITS
    slot = group >> key_bits
    key = group & ((1 << key_bits) - 1)
    low, high = int(bucket.min()), int(bucket.max())
    width = high - low + 1
    keys = int(key.max()) + 1
    present = np.zeros(int(slot.max()) + 1, dtype=bool)
    present[slot] = True
    slots = np.flatnonzero(present)
    if len(slots) * keys * width > DENSE_GRID_LIMIT:
        return None
    rank = np.cumsum(present) - 1
    flat = (rank[slot] * keys + key) * width + (bucket - low)
    grid = np.bincount(flat, weights=counts, minlength=len(slots) * keys * width)
    filled = np.flatnonzero(grid)
    cell_slot = slots[filled // (keys * width)]
    cell_key = (filled // width) % keys
    merged = (((cell_slot << key_bits) | cell_key) << BUCKET_BITS) | (filled % width + low)
    # Counts are integers far below 2**53, so the float sums are exact.
    return merged, grid[filled].astype(np.int64)


def cell_ids(groups: Int64Array, buckets: Int64Array) -> Int64Array:
    """Sketch cell ids: the group in the high bits, the bucket key in the low ``BUCKET_BITS``."""
    return (groups << BUCKET_BITS) | (buckets + _BUCKET_OFFSET)


def cell_groups(cells: Int64Array) -> Int64Array:
    """The group id of each cell."""
    return cells >> BUCKET_BITS


def cell_buckets(cells: Int64Array) -> Int64Array:
    """The bucket key of each cell."""
    return (cells & ((1 << BUCKET_BITS) - 1)) - _BUCKET_OFFSET


def quantile_buckets(
    cells: Int64Array, counts: Int64Array, groups: Int64Array, quantiles: Sequence[float]
) -> list[Int64Array]:
    """Bucket key holding each quantile of each group (cells sorted; every group present).

    The ``q`` quantile of ``n`` values is the ``floor(q * (n - 1))``-th smallest (0-based).
    """
    cum = np.cumsum(counts)
    # A group's cells are the run of ids from ``group << BUCKET_BITS`` up to the next group's.
    first = np.searchsorted(cells, groups << BUCKET_BITS, side="left")
    last = np.searchsorted(cells, (groups + 1) << BUCKET_BITS, side="left")
    before = np.where(first > 0, cum[np.maximum(first - 1, 0)], 0)
    totals = cum[last - 1] - before
    out = []
    for q in quantiles:
        rank = np.floor((totals - 1) * q).astype(np.int64)
        index = np.searchsorted(cum, before + rank, side="right")
        out.append(cell_buckets(cells[index]))
    return out
