"""Sliding windows assembled from prefixes and suffixes of pane blocks (``_stacks``).

A pane window used to be the ``fan``-way merge of its panes at every step; now it is a block's
suffix merged with the next block's prefix, stacks that are kept between steps and computed
again when a pane in them changed. Properties: whatever the order of batches, the prepares,
peeks and closes in between, rows for panes the stacks already hold, and a checkpoint restore
(stacks are not saved: they are rebuilt), every result equals

* the same state finalised with every stack thrown away first (bit for bit: which panes merge
  in which order follows from the window alone, never from what was cached),
* the ``fan``-way merge of its panes (the path before: integers and quantiles exact, sums
  and M2 to float rounding), and
* the polars reference (``test_registry.reference``).

And a step costs about three two-way merges, not ``fan - 1``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors._kernels import merge_cells, merge_state
from shoal.processors.aggregates import AGGREGATES, BATCHES, PANE_CONTINUED
from shoal.processors.partials import PartialRows
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import BUCKET_BITS, KEY_BITS, WindowState
from tests.unit.processors.test_combiner import Harness, make_spec
from tests.unit.processors.test_finalise_ahead import partial_rows
from tests.unit.processors.test_registry import (
    Row,
    add_partial,
    assert_same,
    reference,
    spec_of,
    split,
    values,
)

WINDOWS = [
    {"kind": "sliding", "size_ms": 12, "step_ms": 4},  # fan 3
    {"kind": "sliding", "size_ms": 10, "step_ms": 1},  # fan 10
    {"kind": "sliding", "size_ms": 10, "step_ms": 2},  # fan 5
]
NAMES = [*AGGREGATES, "p50", "p99.9"]

rows_strategy = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(-10, 60), values),
    min_size=1,
    max_size=80,
)


def from_scratch(state: WindowState, windows: list[tuple[int, int]]) -> pl.DataFrame:
    """``peek`` with every stack thrown away first."""
    assert state._stacks is not None
    state._stacks.clear()
    return state.peek(windows)


def fan_way(state: WindowState, windows: list[tuple[int, int]]) -> pl.DataFrame:
    """The path before the stacks: every window the merge of all its panes at once."""
    panes = state.panes
    assert panes is not None
    state.compact()
    spec = state.spec.windows[0]
    fan = spec.size_ms // spec.slide_ms
    parts = []
    shift = KEY_BITS + BUCKET_BITS
    for w, s in windows:
        slot = int(state._slot_ids(np.array([w]), np.array([s]))[0])
        if state._groups:  # rows expanded into the window's own slot
            own = state._groups[0]
            lo, hi = np.searchsorted(own, [slot << KEY_BITS, (slot + 1) << KEY_BITS])
            cells = state._cells[0] if state._cells else np.zeros(0, np.int64)
            first, last = np.searchsorted(cells, [slot << shift, (slot + 1) << shift])
            parts.append(
                (
                    own[lo:hi],
                    {f: c[lo:hi] for f, c in state._columns[0].items()},
                    cells[first:last],
                    state._counts[0][first:last] if state._cells else np.zeros(0, np.int64),
                )
            )
        for i in range(fan):
            pane = panes.merged((w, s + i * spec.slide_ms))
            if pane is None:
                continue
            columns = dict(pane.columns)
            if i == 0:
                columns[BATCHES.name] = columns[BATCHES.name] + columns[PANE_CONTINUED.name]
            parts.append(
                (
                    (slot << KEY_BITS) | pane.keys,
                    columns,
                    (slot << shift) | pane.cells,
                    pane.counts,
                )
            )
    if not parts:
        return state.empty_result()
    groups, columns = merge_state(
        np.concatenate([p[0] for p in parts]),
        {f: np.concatenate([p[1][f] for p in parts]) for f in state._fields},
        state.plan.fields,
    )
    cells, counts = merge_cells(
        np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts])
    )
    return state._finish(groups, columns, cells, counts)


def assert_rounding(got: pl.DataFrame, want: pl.DataFrame) -> None:
    """Equal, but for float rounding of sums and M2 (``mean``, ``sum``, ``stddev``)."""
    got, want = (
        got.drop("window", "end").sort("start", "key"),
        want.drop("window", "end").sort("start", "key"),
    )
    assert got.select("start", "key").rows() == want.select("start", "key").rows()
    for name in got.columns:
        if name in ("mean", "sum", "stddev"):
            for a, b in zip(got[name].to_list(), want[name].to_list(), strict=True):
                assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
        else:
            assert got[name].to_list() == want[name].to_list(), name


def check(state: WindowState, spec: PipelineSpec, windows: list[tuple[int, int]]) -> None:
    """Every way of finishing ``windows`` agrees (state left as it was)."""
    got = state.peek(windows)
    again = from_scratch(state, windows)
    assert got.sort("start", "key").equals(again.sort("start", "key"))
    assert_rounding(got, fan_way(state, windows))


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w['size_ms']}-{w['step_ms']}")
@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy, cuts=st.lists(st.integers(0, 80), max_size=10), data=st.data())
def test_stacked_windows_equal_scratch_fan_way_and_the_reference(
    window: dict[str, Any], rows: list[Row], cuts: list[int], data: st.DataObject
) -> None:
    spec = spec_of(window, NAMES)
    batches = split(sorted(rows, key=lambda r: r[1]) if data.draw(st.booleans()) else rows, cuts)
    partials = partial_rows(spec, batches)
    order = data.draw(st.permutations(range(len(partials))), label="order")
    state = WindowState(spec, spec.plan())
    closed: list[pl.DataFrame] = []
    through: int | None = None
    for index in order:
        add_partial(state, partials[index])
        action = data.draw(st.sampled_from(["none", "peek", "prepare", "close", "restore"]))
        held = state.windows_between(None, 2**62)
        if action == "peek" and held:
            check(state, spec, held[: data.draw(st.integers(1, len(held)))])
        elif action == "prepare" and held:
            state.prepare(held[0][1] + spec.windows[0].size_ms)
        elif action == "close" and held:
            # close only what no later batch reaches: the rest stays open
            through = held[0][1] + spec.windows[0].size_ms
        elif action == "restore":
            state = restored(state, spec)
    if through is not None:
        held = state.windows_between(None, through)
        if held:
            check(state, spec, held)
        closed.append(state.close(through).frame)
    held = state.windows_between(None, 2**62)
    if held:
        check(state, spec, held)
    closed.append(state.close(2**62).frame)
    got = pl.concat([c for c in closed if c.height]) if any(c.height for c in closed) else None
    want = reference(spec, batches)
    if got is None:
        assert want.height == 0
    else:
        assert_same(got, want, spec)


def restored(state: WindowState, spec: PipelineSpec) -> WindowState:
    """A new state from ``state``'s checkpoint (stacks are not in it)."""
    rows: PartialRows | None = state.snapshot_rows()
    panes, forgotten = state.snapshot_panes()
    fresh = WindowState(spec, spec.plan())
    fresh.restore(rows)
    fresh.restore_panes(panes, forgotten)
    return fresh


def test_a_step_costs_about_three_two_way_merges() -> None:
    """Every key in every pane, 40 steps of a 10-pane window: closed one step at a time."""
    spec = spec_of({"kind": "sliding", "size_ms": 10, "step_ms": 1}, ["count", "mean", "p50"])
    keys = [f"k{i}" for i in range(30)]
    state = WindowState(spec, spec.plan())
    batches = [[(k, t, float(t * 7 + i)) for i, k in enumerate(keys)] for t in range(60)]
    for rows in partial_rows(spec, batches):
        add_partial(state, rows)
    assert state._stacks is not None
    closed = [state.close(10).frame]  # windows ending 1 .. 10
    state._stacks.merges = 0
    for end in range(11, 50):  # one window a step, prepared ahead as a combiner does
        state.prepare(end)
        closed.append(state.close(end).frame)
    assert state._stacks.merges <= 3.2 * 39  # fan - 1 = 9 per window before
    got = pl.concat(closed)
    assert got.height == 49 * len(keys)
    want = reference(spec, batches).filter(pl.col("start") + 10 <= 49)
    assert_same(got, want, spec)


def test_a_row_for_a_pane_in_a_stack_makes_it_stale() -> None:
    """Stacks built, then a row for a pane inside a suffix and a prefix: results follow it."""
    spec = spec_of({"kind": "sliding", "size_ms": 4, "step_ms": 1}, ["count", "sum", "p50"])
    early = [[(k, t, float(t)) for k in ("a", "b")] for t in range(12)]
    late = [[("a", 5, 100.0)], [("b", 9, -3.0), ("c", 9, 1.0)]]
    partials = partial_rows(spec, [*early, *late])
    state = WindowState(spec, spec.plan())
    for rows in partials[: len(early)]:
        add_partial(state, rows)
    windows = state.windows_between(None, 12)
    state.peek(windows)  # every stack built
    for rows in partials[len(early) :]:
        add_partial(state, rows)
    check(state, spec, windows)
    got = state.close(12).frame
    want = reference(spec, [*early, *late]).filter(pl.col("start") + 4 <= 12)
    assert_same(got, want, spec)


def test_closed_windows_kept_for_corrections_hold_no_stacks() -> None:
    """With allowed lateness, closed windows stay for corrections but their stacks go: a
    correction finalises its window again from the panes, and equals hopping windows'."""
    spec = make_spec(
        windows=[{"kind": "sliding", "size_ms": 4_000, "step_ms": 1_000, "name": "w"}],
        allowed_lateness_ms=60_000,
    )
    h = Harness(spec)
    h.announce("gw")
    for seq in range(40):
        h.send("gw", seq, [("k", 1_000 * seq + 100, float(seq)), ("j", 1_000 * seq + 900, 1.0)])
        h.combiner.tick()
        stacks = h.combiner.state._stacks
        assert stacks is not None
        assert len(stacks._suffixes) <= 1  # the block of the windows closing next, at most
        assert len(stacks._prefixes) <= 2
    assert h.combiner.state.windows_through(h.combiner.closed_through or 0) > 30  # kept
    step = h.send("gw", 40, [("k", 20_500, 100.0)])  # late, within the allowance
    revised = h.combiner.close_ready(h.clock.now_ms())
    assert step.late == []
    assert revised is not None
    got = revised.frame.filter(pl.col("key") == "k").select("start", "count", "sum").sort("start")
    assert got.rows() == [
        (s, 5, 100.0 + sum(range(s // 1_000, s // 1_000 + 4))) for s in range(17_000, 21_000, 1_000)
    ]
