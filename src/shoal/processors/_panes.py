"""Pane-based hopping: a batch's state per pane of ``slide_ms``, fanned out to its windows.

A hopping window of ``fan = size/slide`` panes holds exactly the rows of its panes, so its state
is the merge of their states. A worker therefore computes state once per (pane, key) — one
membership per row, as for a tumbling window — and gives every window the merge of the batch's
panes it contains, instead of grouping ``fan`` copies of every measurement. Windows that contain
the same panes *of this batch* share one merge: a batch with rows in panes ``p0 .. p1`` needs at
most ``2 (p1 - p0) + 1`` distinct merges (the windows cut off at either end, and the whole), so
for the usual batch (a few panes) the fan-out is a gather of ready state rows.

The result equals grouping the expanded memberships (``Assignment.expanded``) up to float
rounding of the inexact fields (sums, M2), which is the same freedom the combiner's merges take:
the property test in ``tests/unit/processors/test_panes.py`` holds the two paths together.
``batches`` counts one per window whatever the panes, since all rows come from one batch.

Imports only ``_kernels`` and ``aggregates`` (for the ``batches`` field).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shoal.processors._kernels import (
    FieldKernels,
    cell_buckets,
    cell_groups,
    cell_ids,
    gather_runs,
    merge_cells,
    merge_state,
    partial_state,
)
from shoal.processors.aggregates import BATCHES

Int64Array = npt.NDArray[np.int64]
Sketch = tuple[Int64Array, Int64Array, Int64Array]


def fan_out(  # noqa: PLR0917 - the kernel's inputs, as partial_state takes them
    pane: Int64Array,
    fan: int,
    key: Int64Array,
    width: int,
    ts: Int64Array,
    value: npt.NDArray[np.float64],
    fields: Sequence[FieldKernels],
    bucket: Int64Array | None = None,
) -> tuple[Int64Array, dict[str, npt.NDArray[Any]], Sketch | None]:
    """State per (window slot, key) of one batch, as ``_kernels.partial_state`` returns it.

    Args:
        pane: pane slot per row (non-negative); pane ``p`` lies in window slots
            ``p .. p + fan - 1``.
        fan: windows per pane.
        key: dense key id per row, below ``width``.
        width: key ids of the batch.
        ts: event time per row.
        value: value per row.
        fields: state fields (``AggregatePlan.fields``).
        bucket: sketch bucket key per row, or None.

    Returns:
        (group ids ``window slot * width + key`` ascending, fields aligned with them, sketch
        as (index into the groups, bucket, count), or None).
    """
    g, state, sketch = partial_state(pane * width + key, ts, value, fields, bucket)
    return fan_out_state(g, state, sketch, fan, width, fields)


def fan_out_state(  # noqa: PLR0917 - fan_out's second half, with its inputs
    g: Int64Array,
    state: dict[str, npt.NDArray[Any]],
    sketch: Sketch | None,
    fan: int,
    width: int,
    fields: Sequence[FieldKernels],
) -> tuple[Int64Array, dict[str, npt.NDArray[Any]], Sketch | None]:
    """``fan_out`` from one batch's state per (pane slot, key) instead of its rows.

    ``g``: group ids ``pane slot * width + key``, ascending and unique; ``state`` aligned with
    them; ``sketch`` (index into ``g`` ascending, bucket, count) or None. A combiner uses it
    to turn a batch's pane partial into the window rows a worker used to send
    (``partials.expand_panes``).
    """
    windows, ranges, chosen = _pane_ranges(g // width, fan)
    rg, rstate, rsketch = _range_state(g, state, sketch, ranges, width, fields)
    # Every window takes its range's block of state rows (sorted by key), in slot order.
    block = rg // width
    first = np.searchsorted(block, np.arange(len(ranges)), side="left")
    lengths = np.searchsorted(block, np.arange(len(ranges)), side="right") - first
    source = gather_runs(first[chosen], lengths[chosen])
    out_g = np.repeat(windows, lengths[chosen]) * width + rg[source] % width
    out_state = {name: column[source] for name, column in rstate.items()}
    out_sketch = None
    if rsketch is not None:
        row, buckets, counts = rsketch
        cell_first = np.searchsorted(row, np.arange(len(rg)), side="left")
        cell_count = np.searchsorted(row, np.arange(len(rg)), side="right") - cell_first
        cells = gather_runs(cell_first[source], cell_count[source])
        out_row = np.repeat(np.arange(len(source), dtype=np.int64), cell_count[source])
        out_sketch = (out_row, buckets[cells], counts[cells])
    return out_g, out_state, out_sketch


def _pane_ranges(pane_of_row: Int64Array, fan: int) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The windows with rows, the distinct ranges of present panes they hold, and which.

    Returns ``windows`` (window slots holding a pane with rows, ascending), ``ranges`` (an
    (r, 2) array of pane slots) and, per window, the index of its range in ``ranges``. Sized
    by the panes present times ``fan``, never by the span of the batch's timestamps.
    """
    present = np.unique(pane_of_row)
    windows = np.unique((present[:, None] + np.arange(fan, dtype=np.int64)[None, :]).ravel())
    lo = present[np.searchsorted(present, windows - fan + 1, side="left")]
    hi = present[np.searchsorted(present, windows, side="right") - 1]
    pairs = np.stack([lo, hi], axis=1)
    ranges, inverse = np.unique(pairs, axis=0, return_inverse=True)
    return windows, ranges, inverse.reshape(-1).astype(np.int64)


def _range_state(  # noqa: PLR0917 - private; the pane state and how to regroup it
    g: Int64Array,
    state: dict[str, npt.NDArray[Any]],
    sketch: Sketch | None,
    ranges: Int64Array,
    width: int,
    fields: Sequence[FieldKernels],
) -> tuple[Int64Array, dict[str, npt.NDArray[Any]], Sketch | None]:
    """State per (range, key): group ids ``range * width + key``, ascending."""
    pane_of_row = g // width
    if bool((ranges[:, 0] == ranges[:, 1]).all()):
        # One pane per range (a batch within one pane, the usual case): nothing to merge.
        rank = np.searchsorted(ranges[:, 0], pane_of_row)
        return rank * width + g % width, state, sketch
    first = np.searchsorted(pane_of_row, ranges[:, 0], side="left")
    last = np.searchsorted(pane_of_row, ranges[:, 1], side="right")
    rows = gather_runs(first, last - first)
    range_of = np.repeat(np.arange(len(ranges), dtype=np.int64), last - first)
    groups = range_of * width + g[rows] % width
    merged_g, merged = merge_state(groups, {n: c[rows] for n, c in state.items()}, fields)
    if BATCHES.name in merged:
        merged[BATCHES.name] = np.ones(len(merged_g), dtype=np.int64)  # all from one batch
    if sketch is None:
        return merged_g, merged, None
    row, buckets, counts = sketch
    cell_first = np.searchsorted(row, rows, side="left")
    cell_count = np.searchsorted(row, rows, side="right") - cell_first
    cells = gather_runs(cell_first, cell_count)
    cell_group = np.repeat(groups, cell_count)
    merged_cells, merged_counts = merge_cells(cell_ids(cell_group, buckets[cells]), counts[cells])
    merged_row = np.searchsorted(merged_g, cell_groups(merged_cells))
    return merged_g, merged, (merged_row, cell_buckets(merged_cells), merged_counts)
