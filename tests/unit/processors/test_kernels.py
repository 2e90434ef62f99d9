"""The numpy kernels compute exactly what the polars reference expressions define."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors import _kernels
from shoal.processors._kernels import (
    add_cells,
    cell_buckets,
    cell_groups,
    cell_ids,
    merge_cells,
    merge_state,
    partial_state,
    quantile_buckets,
)
from shoal.processors.aggregates import STATE_FIELDS
from shoal.processors.sketch import LogBuckets, quantiles_from_buckets

FIELDS = tuple(STATE_FIELDS)
KERNELS = tuple(STATE_FIELDS.values())
INEXACT = ("sum", "m2")
"""Float sums round differently in numpy and polars; every other field must match exactly."""

rows = st.lists(
    st.tuples(
        st.integers(0, 6),  # group
        st.integers(0, 20),  # ts (few values: many ties)
        st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=80,
)


def reference_partial(data: list[tuple[int, int, float]]) -> pl.DataFrame:
    frame = pl.DataFrame(
        data, schema={"g": pl.Int64, "ts": pl.Int64, "value": pl.Float64}, orient="row"
    )
    return frame.group_by("g").agg(STATE_FIELDS[f].partial.alias(f) for f in FIELDS).sort("g")


def assert_close(got: np.ndarray, want: np.ndarray, name: str, scale: np.ndarray) -> None:
    if name not in INEXACT:
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        tolerance = 1e-9 * np.maximum(scale, 1.0)
        assert (np.abs(got - want) <= tolerance).all(), (name, got, want)


@settings(max_examples=150, deadline=None)
@given(data=rows)
def test_partial_state_matches_the_polars_expressions(data) -> None:
    g = np.array([r[0] for r in data], dtype=np.int64)
    ts = np.array([r[1] for r in data], dtype=np.int64)
    v = np.array([r[2] for r in data], dtype=np.float64)
    groups, state, _ = partial_state(g, ts, v, KERNELS)
    want = reference_partial(data)
    np.testing.assert_array_equal(groups, want["g"].to_numpy())
    scale = (
        pl.DataFrame({"g": g, "a": np.abs(v) * np.abs(v)})
        .group_by("g")
        .agg(pl.col("a").sum())
        .sort("g")["a"]
        .to_numpy()
    )
    for name in FIELDS:
        assert_close(state[name], want[name].to_numpy(), name, scale)


@settings(max_examples=100, deadline=None)
@given(data=rows)
def test_first_and_last_of_rows_in_time_order_match_the_polars_expressions(data) -> None:
    """Rows of each group in strictly rising time: first/last are taken by index, not reduced."""
    distinct = {(g, ts): v for g, ts, v in data}  # one row per (group, ts): no ties
    ordered = [(g, ts, v) for (g, ts), v in sorted(distinct.items(), key=lambda i: i[0][1])]
    g = np.array([r[0] for r in ordered], dtype=np.int64)
    ts = np.array([r[1] for r in ordered], dtype=np.int64)
    v = np.array([r[2] for r in ordered], dtype=np.float64)
    order = np.argsort(g, kind="stable")
    starts, lengths = _kernels.run_bounds(g[order])
    runs = _kernels.Runs(starts, lengths, {"ts": ts[order], "value": v[order]}, {})
    assert runs.increasing("ts")
    groups, state, _ = partial_state(g, ts, v, KERNELS)
    want = reference_partial(ordered)
    np.testing.assert_array_equal(groups, want["g"].to_numpy())
    for name in ("first_ts", "first_value", "last_ts", "last_value"):
        np.testing.assert_array_equal(state[name], want[name].to_numpy(), err_msg=name)


def test_a_tie_or_a_row_out_of_time_order_is_not_increasing() -> None:
    starts, lengths = np.array([0, 3]), np.array([3, 2])
    for ts, rising in (([1, 2, 3, 0, 5], True), ([1, 2, 2, 0, 5], False), ([1, 2, 3, 5, 4], False)):
        runs = _kernels.Runs(starts, lengths, {"ts": np.array(ts)}, {})
        assert runs.increasing("ts") is rising, ts


@settings(max_examples=100, deadline=None)
@given(data=rows, split=st.integers(1, 6))
def test_merge_state_matches_the_polars_merges(data, split) -> None:
    # Partials of arbitrary chunks, merged by numpy and by the polars merge expressions.
    chunks = [data[i::split] for i in range(split)]
    parts = [reference_partial(c) for c in chunks if c]
    stacked = pl.concat(parts)
    want = stacked.group_by("g").agg(STATE_FIELDS[f].merge.alias(f) for f in FIELDS).sort("g")
    groups, merged = merge_state(
        stacked["g"].to_numpy(), {f: stacked[f].to_numpy() for f in FIELDS}, KERNELS
    )
    np.testing.assert_array_equal(groups, want["g"].to_numpy())
    scale = np.abs(want["sum"].to_numpy()) + want["m2"].to_numpy() + 1.0
    for name in FIELDS:
        assert_close(merged[name], want[name].to_numpy(), name, scale * 1e3)


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 5), st.floats(-1e4, 1e4, allow_nan=False)),
        min_size=1,
        max_size=120,
    ),
    quantiles=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
)
def test_sketch_kernels_match_the_polars_reference(data, quantiles) -> None:
    mapping = LogBuckets(0.01)
    g = np.array([r[0] for r in data], dtype=np.int64)
    v = np.array([r[1] for r in data], dtype=np.float64)
    keys = mapping.keys_np(v)
    assert (
        keys.tolist()
        == pl.Series(v).to_frame("v").select(mapping.key_expr(pl.col("v")))["v"].to_list()
    )
    no_ts = np.zeros(len(g), dtype=np.int64)
    groups, _, sketch = partial_state(g, no_ts, v, (STATE_FIELDS["n"],), keys)
    assert sketch is not None
    index, bucket, count = sketch
    cells, counts = merge_cells(cell_ids(groups[index], bucket), count)
    assert (cell_groups(cells) == groups[index]).all() or len(set(cells.tolist())) == len(cells)
    np.testing.assert_array_equal(cell_buckets(cells), bucket)
    picks = quantile_buckets(cells, counts, groups, quantiles)
    frame = pl.DataFrame({"g": groups[index], "bucket": bucket.astype(np.int32), "count": count})
    names = {f"q{i}": q for i, q in enumerate(quantiles)}
    want = quantiles_from_buckets(frame, ["g"], names, mapping).sort("g")
    for i, name in enumerate(names):
        np.testing.assert_allclose(mapping.values_np(picks[i]), want[name].to_numpy(), rtol=1e-15)


@settings(max_examples=100, deadline=None)
@given(
    base=st.lists(st.tuples(st.integers(0, 500), st.integers(1, 9)), max_size=120),
    extra=st.lists(st.tuples(st.integers(0, 500), st.integers(1, 9)), min_size=1, max_size=200),
)
def test_incremental_cell_merge_equals_a_full_merge(base, extra) -> None:
    """Fewer or more new cells than the set holds (a compaction inserts them either way)."""
    cells = np.array([c for c, _ in base], dtype=np.int64)
    counts = np.array([n for _, n in base], dtype=np.int64)
    merged, merged_counts = merge_cells(cells, counts)
    new = np.array([c for c, _ in extra], dtype=np.int64)
    new_counts = np.array([n for _, n in extra], dtype=np.int64)
    got = add_cells(merged, merged_counts, new, new_counts)
    want = merge_cells(np.concatenate([cells, new]), np.concatenate([counts, new_counts]))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 50), st.floats(-1e4, 1e4, allow_nan=False)),
        min_size=1,
        max_size=300,
    )
)
def test_the_dense_grid_and_the_sort_count_the_same_buckets(data) -> None:
    """Both ways of counting (group, bucket) cells agree, whichever the batch's shape picks;
    values on both sides of zero make the wide grids the sort is there for."""
    groups = np.array([g for g, _ in data], dtype=np.int64)
    buckets = LogBuckets(0.01).keys_np(np.array([v for _, v in data]))
    order = np.argsort(groups, kind="stable")
    unique, lengths = np.unique(groups, return_counts=True)
    limit = _kernels.SPARSE_CELLS_PER_ROW
    try:
        _kernels.SPARSE_CELLS_PER_ROW = 1 << 30
        dense = _kernels._bucket_counts(unique, groups, buckets, order, lengths)
        _kernels.SPARSE_CELLS_PER_ROW = 0
        by_sort = _kernels._bucket_counts(unique, groups, buckets, order, lengths)
    finally:
        _kernels.SPARSE_CELLS_PER_ROW = limit
    for got, want in zip(by_sort, dense, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(dense[2].sum()) == len(data)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3), min_size=1, max_size=60),
    dtype=st.sampled_from([np.int64, np.float64, np.int32, np.bool_]),
    ufunc=st.sampled_from([np.add, np.minimum, np.maximum]),
    seed=st.integers(0, 2**32 - 1),
)
def test_folding_short_runs_equals_reduceat_bit_for_bit(lengths, dtype, ufunc, seed) -> None:
    """Runs of one or two rows are folded element by element: the same values and dtype."""
    values = (np.random.default_rng(seed).standard_normal(sum(lengths)) * 1e6).astype(dtype)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    lens = np.array(lengths, dtype=np.int64)
    got = _kernels.reduce_runs(ufunc, values, starts, lens, int(lens.max()))
    want = ufunc.reduceat(values, starts)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@settings(max_examples=150, deadline=None)
@given(
    runs=st.integers(1, 60),
    length=st.integers(2, _kernels.FOLDED_RUN_ROWS + 2),
    dtype=st.sampled_from([np.int64, np.float64]),
    ufunc=st.sampled_from([np.add, np.minimum, np.maximum]),
    zeros=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_folding_runs_of_one_length_equals_reduceat_bit_for_bit(
    runs, length, dtype, ufunc, zeros, seed
) -> None:
    """Runs all of one length are folded by row position: the same values, bit for bit (float
    sums in reduceat's order; signed zeros too), and longer runs still go to ``reduceat``."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(runs * length) * 10.0 ** rng.integers(-6, 7, runs * length)
    if zeros:
        values = np.where(rng.random(len(values)) < 0.5, 0.0, -0.0)
    values = values.astype(dtype)
    starts = np.arange(0, runs * length, length, dtype=np.int64)
    lens = np.full(runs, length, dtype=np.int64)
    got = _kernels.reduce_runs(ufunc, values, starts, lens, length)
    want = ufunc.reduceat(values, starts)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(-3, 3), max_size=40))
def test_run_bounds_finds_every_run(ids) -> None:
    sorted_ids = np.sort(np.array(ids, dtype=np.int64))
    starts, lengths = _kernels.run_bounds(sorted_ids)
    runs = [(k, len(list(g))) for k, g in itertools.groupby(sorted_ids.tolist())]
    assert lengths.tolist() == [n for _, n in runs]
    assert sorted_ids[starts].tolist() == [k for k, _ in runs]
    assert starts.dtype == lengths.dtype == np.int64


@settings(max_examples=150, deadline=None)
@given(first=rows, second=rows, same_keys=st.booleans())
def test_merging_two_states_equals_merge_state_of_both(first, second, same_keys) -> None:
    """``merge_pair`` (interleaving when the keys are the same) is ``merge_state`` of both."""

    def state(data):
        g = np.array([r[0] for r in data], dtype=np.int64)
        ts = np.array([r[1] for r in data], dtype=np.int64)
        value = np.array([r[2] for r in data], dtype=np.float64)
        return partial_state(g, ts, value, KERNELS)[:2]

    if same_keys:  # every key of the first state, rows of the second
        keys = sorted({g for g, _, _ in first})
        second = [(keys[i % len(keys)], ts, v) for i, (_, ts, v) in enumerate(second)]
        second += [(k, 3, 1.5) for k in keys]
    (keys_a, state_a), (keys_b, state_b) = state(first), state(second)
    got_keys, got = _kernels.merge_pair(keys_a, state_a, keys_b, state_b, KERNELS)
    want_keys, want = merge_state(
        np.concatenate((keys_a, keys_b)),
        {f: np.concatenate((state_a[f], state_b[f])) for f in FIELDS},
        KERNELS,
    )
    np.testing.assert_array_equal(got_keys, want_keys)
    for name in FIELDS:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


sorted_cells = st.dictionaries(st.integers(0, 300), st.integers(1, 9), max_size=80)


@settings(max_examples=150, deadline=None)
@given(first=sorted_cells, second=sorted_cells)
def test_merging_two_sorted_cell_sets_sums_equal_cells(first, second) -> None:
    def arrays(cells):
        ordered = sorted(cells.items())
        return (
            np.array([c for c, _ in ordered], dtype=np.int64),
            np.array([n for _, n in ordered], dtype=np.int64),
        )

    cells, counts = _kernels.merge_sorted_cells(*arrays(first), *arrays(second))
    want = collections.Counter(first) + collections.Counter(second)
    assert cells.tolist() == sorted(want)
    assert counts.tolist() == [want[c] for c in sorted(want)]
    assert cells.dtype == counts.dtype == np.int64


def test_a_group_sorter_reuses_the_sort_of_equal_ids_and_only_those() -> None:
    """Batches whose ids repeat (a gateway reading its sensors in a fixed order) reuse the last
    sort; other ids, and ids changed in place by the caller afterwards, are sorted afresh.
    Either way the state is what ``partial_state`` computes without a sorter."""
    rng = np.random.default_rng(7)
    sorter = _kernels.GroupSorter()
    layout = rng.permutation(50)
    repeating = np.tile(layout, 4).astype(np.int64)
    other = rng.integers(0, 60, 200).astype(np.int64)
    sorts = []
    for groups in (repeating, repeating.copy(), other, repeating, repeating):
        ts = np.arange(len(groups), dtype=np.int64)
        value = rng.standard_normal(len(groups))
        bucket = LogBuckets(0.01).keys_np(value)
        got = partial_state(groups, ts, value, KERNELS, bucket, sorter=sorter)
        want = partial_state(groups, ts, value, KERNELS, bucket)
        np.testing.assert_array_equal(got[0], want[0])
        for name in FIELDS:
            np.testing.assert_array_equal(got[1][name], want[1][name], err_msg=name)
        for got_part, want_part in zip(got[2], want[2], strict=True):
            np.testing.assert_array_equal(got_part, want_part)
        sorts.append(sorter.sort(groups))
    assert sorts[0] is sorts[1]
    assert sorts[2] is not sorts[1]
    assert sorts[3] is not sorts[2]
    assert sorts[4] is sorts[3]
    repeating[0] = 59  # the caller's array changed: not the ids the sort was made for
    assert sorter.sort(repeating) is not sorts[4]
    assert not sorts[4].lengths.flags.writeable
