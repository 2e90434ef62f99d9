"""Pane-based hopping (``_panes.fan_out``) gives the state of grouping every window membership.

The old hot path repeated each measurement once per window (``Assignment.expanded``) and
grouped the copies; the pane path groups each measurement once, by pane, and fans the pane
states out. For any rows, keys, gaps between panes and window shapes the two agree: exactly on
integer and order fields and sketch cells, to rounding on float sums.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors._kernels import gather_runs, partial_state
from shoal.processors._panes import fan_out
from shoal.processors.aggregates import AggregatePlan, AggregateSpec
from shoal.processors.sketch import LogBuckets
from shoal.processors.windows import HOPPING, WindowSpec

PLAN = AggregatePlan.for_aggregates(
    [AggregateSpec(n) for n in ("count", "sum", "mean", "min", "max", "stddev", "first", "last")]
)
INEXACT = {"sum", "m2"}
BUCKETS = LogBuckets(0.01)

shapes = st.sampled_from([(2, 1), (3, 1), (10, 5), (12, 3), (60, 1), (6, 6)])


def grouped(pairs: tuple[npt.NDArray[Any], dict[str, Any], Any]) -> dict[int, dict[str, Any]]:
    """Group id -> fields and sketch cells, for comparing two kernels' outputs."""
    g, state, sketch = pairs
    out: dict[int, dict[str, Any]] = {
        int(gid): {name: col[i].item() for name, col in state.items()} for i, gid in enumerate(g)
    }
    if sketch is not None:
        for row, bucket, count in zip(*sketch, strict=True):
            out[int(g[row])].setdefault("cells", []).append((int(bucket), int(count)))
    return out


@settings(max_examples=200, deadline=None)
@given(
    shape=shapes,
    rows=st.lists(
        st.tuples(st.integers(0, 3), st.integers(-40, 40), st.integers(-50, 50)),
        min_size=1,
        max_size=80,
    ),
    sketch=st.booleans(),
)
def test_fan_out_equals_grouping_every_membership(
    shape: tuple[int, int], rows: list[tuple[int, int, int]], *, sketch: bool
) -> None:
    size, slide = shape
    window = WindowSpec("w", "hopping", size, slide)
    key = np.array([r[0] for r in rows], dtype=np.int64)
    ts = np.array([r[1] for r in rows], dtype=np.int64)
    value = np.array([r[2] / 4 for r in rows], dtype=np.float64)
    bucket = BUCKETS.keys_np(value) if sketch else None
    width = 4
    panes = HOPPING.assign(ts, window)
    assert panes.per_row == 1
    new = fan_out(panes.slot, panes.fan, key, width, ts, value, PLAN.fields, bucket)
    every = panes.expanded()
    per_row = every.per_row
    old = partial_state(
        every.slot * width + np.repeat(key, per_row),
        np.repeat(ts, per_row),
        np.repeat(value, per_row),
        PLAN.fields,
        None if bucket is None else np.repeat(bucket, per_row),
    )
    assert np.array_equal(new[0], old[0])  # the same groups, in the same order
    got, want = grouped(new), grouped(old)
    for gid, fields in want.items():
        for name, expected in fields.items():
            if name in INEXACT:
                assert math.isclose(got[gid][name], expected, rel_tol=1e-9, abs_tol=1e-9)
            else:
                assert got[gid][name] == expected, (gid, name)


def test_a_batch_in_one_pane_is_gathered_not_merged() -> None:
    """One pane, ten keys: every one of the 60 windows gets the pane's state rows."""
    window = WindowSpec("w", "hopping", 60_000, 1_000)
    ts = np.arange(1_000, 2_000, 10, dtype=np.int64)
    key = np.arange(len(ts), dtype=np.int64) % 10
    value = np.ones(len(ts))
    panes = HOPPING.assign(ts, window)
    g, state, _ = fan_out(panes.slot, panes.fan, key, 10, ts, value, PLAN.fields)
    assert len(g) == 60 * 10
    assert (state["n"] == 10).all()
    assert (state["batches"] == 1).all()
    assert np.array_equal(panes.starts(np.unique(g // 10)), np.arange(-58_000, 2_000, 1_000))


def test_batches_count_once_per_window_across_panes() -> None:
    """Rows in three panes of one batch: the windows holding all three count one batch."""
    window = WindowSpec("w", "hopping", 5_000, 1_000)
    ts = np.array([0, 1_000, 2_000], dtype=np.int64)
    panes = HOPPING.assign(ts, window)
    g, state, _ = fan_out(
        panes.slot, panes.fan, np.zeros(3, dtype=np.int64), 1, ts, np.ones(3), PLAN.fields
    )
    starts = panes.starts(g).tolist()
    assert starts == [-4_000, -3_000, -2_000, -1_000, 0, 1_000, 2_000]
    assert state["n"].tolist() == [1, 2, 3, 3, 3, 2, 1]
    assert state["batches"].tolist() == [1] * 7


def test_gather_runs() -> None:
    starts = np.array([5, 0, 9], dtype=np.int64)
    lengths = np.array([2, 0, 3], dtype=np.int64)
    assert gather_runs(starts, lengths).tolist() == [5, 6, 9, 10, 11]
    assert gather_runs(starts[:0], lengths[:0]).tolist() == []
