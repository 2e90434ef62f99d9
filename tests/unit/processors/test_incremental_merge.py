"""Merging a few pending state rows into a large merged base gives the full merge, bit for bit.

``WindowState.compact`` inserts pending rows into the merged base (``_insert_state``) when
they are few next to it, instead of re-sorting everything: a sliding window's pane state
takes rows for its newest panes only. Property: whatever the batches and the compactions in
between, every group and every field (float sums and M2 included, to the last bit) equal
what a full re-sort at the same compactions gives, for every time window kind, for the window
state and the pane state alike; and the results equal the polars reference. Sketch cells
(integer counts: any order sums alike) are inserted into a merged base however many are
pending, and a compaction allocates about the cells it keeps.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors import state as state_module
from shoal.processors._kernels import merge_state, partial_state
from shoal.processors._stacks import Keyed
from shoal.processors.aggregates import STATE_FIELDS
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


def test_a_compaction_allocates_about_the_cells_it_keeps() -> None:
    """Pending sketch cells as many as the merged base's, merged into it: at most 4x their bytes.

    2,000 keys over 100 magnitudes, each key's values in a 1.25 range: ~30 buckets a key,
    ~130 overall. Merged on a dense (slot, key, bucket) grid (``bincount``, the grid mostly
    empty) the compaction peaked at 7.9x the cells' bytes; sorted and inserted into the base
    (``add_cells``) at 2.8x (the old and the new base both alive while it is built).
    """
    spec = spec_of({"kind": "tumbling", "size_ms": 1000}, ["count", "p50"])

    def batch(seed: int) -> list[Row]:
        rng = np.random.default_rng(seed)
        key = rng.integers(0, 2_000, 150_000)
        value = 1.02 ** (key % 100) * rng.uniform(0.8, 1.25, len(key))
        ts = rng.integers(0, 3_000, len(key))
        return [(f"k{k}", int(t), float(v)) for k, t, v in zip(key, ts, value, strict=True)]

    first, second = partial_rows(spec, [batch(1), batch(2)])
    state = WindowState(spec, spec.plan())
    add_partial(state, first)
    state.compact()
    add_partial(state, second)
    held = sum(c.nbytes + n.nbytes for c, n in zip(state._cells, state._counts, strict=True))
    assert [len(c) > 80_000 for c in state._cells] == [True, True]  # base, then as many pending
    tracemalloc.start()
    try:
        state.compact()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * held, f"compaction peaked at {peak / held:.1f}x the cells' bytes"


pane_rows = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 20), st.floats(-1e6, 1e6)), min_size=1
)


@settings(max_examples=150, deadline=None)
@given(base=pane_rows, appended=pane_rows, same_keys=st.booleans())
def test_a_pane_merges_appended_rows_as_the_full_merge_does(base, appended, same_keys) -> None:
    """``_merged_into`` (two runs when each appended key is there once) equals ``merge_state``
    of the pane's rows and the appended ones, bit for bit; with repeated keys as well."""
    fields = tuple(STATE_FIELDS.values())

    def state(rows):
        g = np.array([r[0] for r in rows], dtype=np.int64)
        ts = np.array([r[1] for r in rows], dtype=np.int64)
        value = np.array([r[2] for r in rows], dtype=np.float64)
        return partial_state(g, ts, value, fields)[:2]

    if same_keys:  # one appended row per key of the pane, in no particular order
        held = sorted({g for g, _, _ in base})
        appended = [(held[-1 - i], ts, v) for i, (_, ts, v) in enumerate(appended[: len(held)])]
    base_keys, base_columns = state(base)
    keys, columns = state(appended)
    shuffled = np.random.default_rng(len(appended)).permutation(len(keys))
    keys, columns = keys[shuffled], {f: c[shuffled] for f, c in columns.items()}
    if not same_keys:  # some keys twice: the full merge
        keys, columns = (
            np.concatenate((keys, keys)),
            {f: np.concatenate((c, c)) for f, c in columns.items()},
        )
    empty = np.zeros(0, dtype=np.int64)
    pane = Keyed(base_keys, base_columns, empty, empty)
    got_keys, got = state_module._merged_into(pane, keys, columns, fields)
    want_keys, want = merge_state(
        np.concatenate((base_keys, keys)),
        {f: np.concatenate((base_columns[f], c)) for f, c in columns.items()},
        fields,
    )
    np.testing.assert_array_equal(got_keys, want_keys)
    for name, column in want.items():
        np.testing.assert_array_equal(got[name], column, err_msg=name)
