"""Windows finalised ahead of their close, peeked for corrections and closed stay exact.

``WindowState.prepare`` finalises the windows ending at or before a threshold once the
watermark has passed their end, ``peek`` finalises closed windows kept for corrections, and
``close`` hands out the prepared results unless a row reached a prepared window meanwhile.
With sliding and hopping windows ``size/slide`` windows are open per key, so these paths
run at every step. Property: whatever the order of the partials, the compactions in between
and the batches that arrive after the finalisation (a row may reach a prepared window: it
must be finalised again), the prepared results, a ``peek`` and the close equal the polars
reference over every row, window by window (``test_registry.reference``).
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.aggregates import AGGREGATES
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder, PartialRows
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import TIDY_SHARE, WindowState
from tests.support.datasets import frame_of
from tests.unit.processors.test_registry import (
    WINDOW_EXAMPLES,
    Row,
    add_partial,
    assert_same,
    reference,
    rows_strategy,
    spec_of,
    split,
)

TIME_WINDOWS = [w for kind, ws in WINDOW_EXAMPLES.items() if kind != "count" for w in ws]


def partial_rows(spec: PipelineSpec, batches: list[list[Row]]) -> list[PartialRows]:
    """Each batch's partial state rows, over the wire."""
    builder = PartialBuilder(spec, "w")
    out = []
    for seq, rows in enumerate(batches):
        info = BatchInfo("gw", seq, "s", 0, None, None, 0, 0, "w")
        (partial,) = builder.build(frame_of(rows), info, 0)
        decoded = Partial.decode(partial.encode()).rows
        assert decoded is not None
        out.append(decoded)
    return out


def ending_by(frame: pl.DataFrame, spec: PipelineSpec, through: int, *, by: bool) -> pl.DataFrame:
    end = pl.col("start") + spec.windows[0].size_ms
    return frame.filter(end <= through if by else end > through)


@pytest.mark.parametrize("window", TIME_WINDOWS, ids=lambda w: w.get("kind", "tumbling"))
@settings(max_examples=40, deadline=None)
@given(
    rows=rows_strategy,
    cuts=st.lists(st.integers(0, 60), max_size=8),
    through=st.integers(-30, 40),
    data=st.data(),
)
def test_prepared_peeked_and_closed_windows_equal_the_reference(
    window: dict[str, Any], rows: list[Row], cuts: list[int], through: int, data: st.DataObject
) -> None:
    spec = spec_of(window, [*AGGREGATES, "p50", "p99.9"])
    batches = split(rows, cuts)
    partials = partial_rows(spec, batches)
    order = data.draw(st.permutations(range(len(partials))), label="order")
    before = data.draw(st.integers(0, len(order)), label="applied before prepare")
    state = WindowState(spec, spec.plan())
    for index in order[:before]:
        add_partial(state, partials[index])
        if data.draw(st.booleans(), label="compact"):
            state.compact()
    early = [batches[i] for i in order[:before]]
    state.prepare(through)
    prepared = state.prepared_frame
    want_early = ending_by(reference(spec, early), spec, through, by=True) if early else None
    if want_early is None or want_early.height == 0:
        assert prepared is None or prepared.height == 0
    else:
        assert prepared is not None
        assert_same(prepared, want_early, spec)
        assert_same(state.peek(state.windows_between(None, through)), want_early, spec)
    for index in order[before:]:  # may reach prepared windows: they are finalised again
        add_partial(state, partials[index])
        if data.draw(st.booleans(), label="compact"):
            state.compact()
    want = reference(spec, batches)
    for got, by in ((state.close(through).frame, True), (state.close(2**62).frame, False)):
        expected = ending_by(want, spec, through, by=by)
        assert got.height == expected.height
        if got.height:
            assert_same(got, expected, spec)


def test_tidy_merges_only_once_pending_rows_are_a_share_of_the_state() -> None:
    """A combiner's tick calls ``tidy``: a merge sorts everything held, so it waits until the
    rows appended since the last one are 1/``TIDY_SHARE`` of all; the results are the same."""
    spec = spec_of({"kind": "tumbling", "size_ms": 1_000}, ["count", "mean", "p50"])
    first = [(f"k{i}", 10, float(i)) for i in range(400)]  # 400 keys: the merged base
    small = [[(f"k{i}", 20 + b, float(i + b)) for i in range(40)] for b in range(12)]
    batches = [first, *small]
    partials = partial_rows(spec, batches)
    state = WindowState(spec, spec.plan())
    state.add(partials[0])
    state.tidy()  # all of it pending: merged
    assert state.pending_rows == 0
    tidied = []
    for partial in partials[1:]:
        state.add(partial)
        pending = state.pending_rows
        due = pending * TIDY_SHARE >= state.rows
        state.tidy()
        assert state.pending_rows == (0 if due else pending)
        tidied.append(due)
    assert not tidied[0]  # one small partial next to 400 keys waits
    assert any(tidied)  # a few of them are worth a merge
    assert_same(state.close(2**62).frame, reference(spec, batches), spec)


def test_pane_windows_are_not_prepared_again_soon_after_rows_made_them_stale() -> None:
    """A sliding window assembled ahead and again at its close (a row reached it in between)
    is not assembled ahead at the next closes: with large batches that is every close."""
    spec = spec_of({"kind": "sliding", "size_ms": 10, "step_ms": 5}, ["count", "p50"])
    partials = partial_rows(
        spec,
        [[("a", 1, 1.0), ("b", 6, 2.0)], [("a", 8, 3.0)], [("a", 12, 4.0), ("b", 16, 5.0)]],
    )
    state = WindowState(spec, spec.plan())
    add_partial(state, partials[0])
    state.prepare(10)
    assert state.prepared_frame is not None
    add_partial(state, partials[1])  # reaches [0, 10): stale
    assert state.prepared_frame is None
    assert state.close(10).frame.height > 0
    add_partial(state, partials[2])
    state.prepare(15)
    assert state.prepared_frame is None  # not assembled ahead: the close does it
    closed = state.close(15).frame
    assert closed.select("start", "key", "count").rows() == [(5, "a", 2)]  # b: no trigger
