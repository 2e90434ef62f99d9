"""Merging a few pending state rows into a large merged base gives the full merge, bit for bit.

``WindowState.compact`` inserts pending rows into the merged base (``_insert_state``) when
they are few next to it, instead of re-sorting everything: a sliding window's pane state
takes rows for its newest panes only. Property: whatever the batches and the compactions in
between, every group and every field (float sums and M2 included, to the last bit) equal
what a full re-sort at the same compactions gives, for every time window kind, for the window
state and the pane state alike; and the results equal the polars reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors import state as state_module
from shoal.processors.state import WindowState
from tests.unit.processors.test_finalise_ahead import TIME_WINDOWS, partial_rows
from tests.unit.processors.test_registry import Row, add_partial, rows_strategy, spec_of

AGGREGATES = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50"]
KEYS = [f"k{i}" for i in range(40)]

big_batch = st.lists(
    st.tuples(st.sampled_from(KEYS), st.integers(-25, 25), st.floats(-1e6, 1e6)),
    min_size=150,
    max_size=300,
)

Held = list[tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]]


def fed(spec: Any, partials: list[Any], compactions: list[bool], *, insert: bool) -> Held:
    """The merged groups and columns of a state (and its panes) fed ``partials``."""
    saved = state_module.INSERT_SHARE
    state_module.INSERT_SHARE = saved if insert else 2**62  # type: ignore[misc]
    calls = 0
    original = state_module._insert_state

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args)

    state_module._insert_state = counted  # type: ignore[assignment]
    try:
        state = WindowState(spec, spec.plan())
        for rows, compact in zip(partials, compactions, strict=True):
            add_partial(state, rows)
            if compact:
                state.compact()
        state.compact()
    finally:
        state_module.INSERT_SHARE = saved  # type: ignore[misc]
        state_module._insert_state = original  # type: ignore[assignment]
    assert insert or calls == 0
    held = [(state._groups[0], state._columns[0])] if state._groups else []
    if state.panes is not None:
        for pane in sorted(state.panes.held()):
            merged = state.panes.merged(pane)
            assert merged is not None
            held.append((merged.keys, merged.columns))
    return held


@pytest.mark.parametrize("window", TIME_WINDOWS, ids=lambda w: w.get("kind", "tumbling"))
@settings(max_examples=15, deadline=None)
@given(first=big_batch, later=st.lists(rows_strategy, min_size=1, max_size=5), data=st.data())
def test_inserting_pending_rows_equals_the_full_merge(
    window: dict[str, object], first: list[Row], later: list[list[Row]], data: st.DataObject
) -> None:
    spec = spec_of(window, AGGREGATES)
    partials = partial_rows(spec, [first, *later])
    compactions = [True, *(data.draw(st.booleans()) for _ in later)]
    inserted = fed(spec, partials, compactions, insert=True)
    resorted = fed(spec, partials, compactions, insert=False)
    assert len(inserted) == len(resorted)
    for (g1, c1), (g2, c2) in zip(inserted, resorted, strict=True):
        assert np.array_equal(g1, g2)
        assert c1.keys() == c2.keys()
        for name in c1:
            assert c1[name].dtype == c2[name].dtype, name
            assert np.array_equal(c1[name], c2[name], equal_nan=c1[name].dtype.kind == "f"), name


def test_a_small_batch_is_inserted_not_resorted() -> None:
    spec = spec_of({"kind": "sliding", "size_ms": 10, "step_ms": 1}, AGGREGATES)
    first = [(k, t, float(t)) for k in KEYS for t in range(10)]
    partials = partial_rows(spec, [first, [("k1", 9, 1.0), ("new", 10, 2.0)]])
    calls = []
    original = state_module._insert_state
    state_module._insert_state = lambda *a: calls.append(1) or original(*a)  # type: ignore[assignment]
    try:
        state = WindowState(spec, spec.plan())
        for rows in partials:
            add_partial(state, rows)
            state.compact()
    finally:
        state_module._insert_state = original  # type: ignore[assignment]
    assert calls == [1]  # the pane state took the second batch by inserts
