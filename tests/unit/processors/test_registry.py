"""Every registry entry, through the hot path, equals its own polars reference.

For each aggregate in ``AGGREGATES`` (and quantiles) and each window kind in
``WINDOW_KINDS``: random rows split into random batches become partials
(``PartialBuilder``: the window kind's ``assign`` and the state fields' kernels), cross the
wire, and are merged by a combiner's ``WindowState`` in a random order with compactions at
random points; the finalised results must equal the aggregate's ``reference`` expression over
all rows, grouped by the window kind's ``with_window_starts``. Count windows ship rows, not
state: the combiner's ``CountState`` takes the partials in a drawn order and the groups come
from the kind's ``with_count_index`` (identified by ``index`` where time windows have
``start``). A new entry is tested here without writing a line; its own test file covers what
is special about it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.aggregates import (
    AGGREGATES,
    ALIASES,
    ALWAYS,
    BUILTIN,
    QUANTILES,
    STATE_FIELDS,
)
from shoal.processors.count import CountState
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder, PartialRows
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.state import WindowState
from shoal.processors.windows import COUNT, WINDOW_KINDS, kind_of
from tests.support.datasets import frame_of

WINDOW_EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "tumbling": [{"size_ms": 7}],
    "hopping": [
        {"kind": "hopping", "size_ms": 10, "slide_ms": 5},
        {"kind": "hopping", "size_ms": 12, "slide_ms": 3},
    ],
    "sliding": [
        {"kind": "sliding", "size_ms": 10, "step_ms": 1},
        {"kind": "sliding", "size_ms": 12, "step_ms": 4},
    ],
    "count": [{"kind": "count", "n": 3}, {"kind": "count", "n": 1}],
}
"""Window tables to test each kind with: a new kind needs an entry here."""

Row = tuple[str, int, float]

values = st.one_of(
    # squares of magnitudes below ~1e-154 underflow: no float stddev survives those
    st.floats(-1e6, 1e6).filter(lambda v: v == 0.0 or abs(v) >= 1e-100),
    st.integers(-1_000, 1_000).map(float),
    st.sampled_from([0.0, 20.0, -20.0, 1e6 + 0.5]),
)
rows_strategy = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(-25, 25), values),
    min_size=1,
    max_size=60,
)


def spec_of(window: dict[str, Any], aggregates: list[str]) -> PipelineSpec:
    return parse_pipeline({"name": "registry", "windows": [window], "aggregates": aggregates})


def add_partial(state: WindowState, rows: PartialRows) -> None:
    """A partial's rows into ``state`` as a combiner takes them when none is late: pane rows
    (sliding windows) into the pane state, unless a key's panes have a gap (then expanded)."""
    rest, _ = state.take_panes(rows, lambda oldest_end: True)
    if rest is not None:
        state.add(rest)


def hot_path(spec: PipelineSpec, batches: list[list[Row]], data: st.DataObject) -> pl.DataFrame:
    """Partials per batch, over the wire, merged in a drawn order with drawn compactions."""
    builder = PartialBuilder(spec, "w")
    partials = []
    for seq, rows in enumerate(batches):
        info = BatchInfo("gw", seq, "s", 0, None, None, 0, 0, "w")
        (partial,) = builder.build(frame_of(rows), info, 0)
        partials.append(Partial.decode(partial.encode()))
    plan = spec.plan()
    if spec.windows[0].by_count:
        counts = CountState(spec, plan)
        for index in data.draw(st.permutations(range(len(partials))), label="order"):
            events = partials[index].events
            assert events is not None
            counts.add(events, "gw", index, np.ones(len(events), dtype=bool))
        return counts.finalise(2**62, (0, 1), flush=True).drop("start").rename({"index": "start"})
    state = WindowState(spec, plan)
    for index in data.draw(st.permutations(range(len(partials))), label="order"):
        rows = partials[index].rows
        assert rows is not None
        add_partial(state, rows)
        if data.draw(st.booleans(), label="compact"):
            state.compact()
    return state.close(2**62).frame


def reference(spec: PipelineSpec, batches: list[list[Row]]) -> pl.DataFrame:
    """The registry's reference expressions over all rows, windows from the kind's reference."""
    window = spec.windows[0]
    mapping = LogBuckets(spec.sketch_accuracy)
    rows = pl.concat(
        frame_of(b).with_columns(batch=pl.lit(i)) for i, b in enumerate(batches)
    ).rename({"sensor_id": "key"})
    exprs = [
        pl.len().cast(pl.Int64).alias("rows"),
        pl.col("batch").n_unique().cast(pl.Int64).alias("batches"),
        pl.col("value").abs().sum().alias("_abs_sum"),
    ]
    for aggregate in spec.aggregates:
        if aggregate.quantile is None:
            expr = AGGREGATES[aggregate.name].reference
        else:
            expr = QUANTILES.reference(aggregate.quantile, mapping)
        exprs.append(expr.alias(aggregate.name))
    if window.by_count:
        rows = rows.with_columns(
            gateway_id=pl.lit("gw"), seq="batch", row=pl.int_range(pl.len()).over("batch")
        )
        indexed = COUNT.with_count_index(rows, window).rename({"index": "start"})
        return indexed.group_by("start", "key").agg(exprs)
    kind = kind_of(window)
    return (
        kind.with_window_starts(rows, window)
        .group_by("start", "key")
        .agg(*exprs, kind.emitted_reference(window).alias("_emitted"))
        .filter(pl.col("_emitted"))
    )


def assert_same(got: pl.DataFrame, want: pl.DataFrame, spec: PipelineSpec) -> None:
    keys = ["start", "key"]
    window = spec.windows[0]
    assert got["window"].unique().to_list() == [window.name]
    if not window.by_count:
        assert (got["end"] - got["start"] == window.size_ms).all()
    assert sorted(got.select(keys).rows()) == sorted(want.select(keys).rows())
    joined = want.join(got, on=keys, suffix="_got")
    for row in joined.iter_rows(named=True):
        where = f"start={row['start']} key={row['key']}"
        assert (row["rows_got"], row["batches_got"]) == (row["rows"], row["batches"]), where
        yardstick = row["_abs_sum"] / row["rows"]
        for aggregate in spec.aggregates:
            name = aggregate.name
            want_value, got_value = row[name], row[f"{name}_got"]
            if aggregate.quantile is not None:
                assert got_value == pytest.approx(want_value, rel=1e-12, abs=1e-300), (where, name)
            elif AGGREGATES[name].exact or want_value is None:
                assert got_value == want_value, (where, name, got_value, want_value)
            else:  # float sums: summation order differs
                tolerance = 1e-7 * max(abs(want_value), yardstick, 1e-300)
                assert math.isclose(got_value, want_value, rel_tol=0, abs_tol=tolerance), (
                    where,
                    name,
                    got_value,
                    want_value,
                )


def split(rows: list[Row], cuts: list[int]) -> list[list[Row]]:
    bounds = sorted({0, len(rows), *(min(c, len(rows)) for c in cuts)})
    return [rows[a:b] for a, b in itertools.pairwise(bounds) if b > a]


WINDOWS = [w for kind in WINDOW_EXAMPLES.values() for w in kind]


def test_every_window_kind_has_examples() -> None:
    assert set(WINDOW_EXAMPLES) == set(WINDOW_KINDS)
    for kind, windows in WINDOW_EXAMPLES.items():
        assert all(spec_of(w, ["count"]).windows[0].kind == kind for w in windows)


def test_names_are_unambiguous() -> None:
    """One entry per name, one field object per column name, aliases that point elsewhere."""
    assert len(AGGREGATES) == len(BUILTIN)
    fields = {id(f): f for a in BUILTIN for f in (*a.state, *ALWAYS)}
    needed = {id(d): d for f in fields.values() for d in f.needs}
    assert len({f.name for f in {**fields, **needed}.values()}) == len({**fields, **needed})
    assert set(STATE_FIELDS) == {f.name for f in {**fields, **needed}.values()}
    for name in AGGREGATES:
        assert QUANTILES.parse(name) is None, name
        assert name not in ALIASES, name
    assert all(alias not in AGGREGATES and QUANTILES.parse(alias) is None for alias in ALIASES)


def test_every_name_is_accepted_by_pipeline_specs() -> None:
    spec = spec_of(WINDOWS[0], [*AGGREGATES, "p50", "p99.9"])
    assert spec.aggregate_names == (*AGGREGATES, "p50", "p99.9")
    assert spec.quantiles == (0.5, pytest.approx(0.999))
    for entry in AGGREGATES.values():
        for alias in entry.aliases:
            assert spec_of(WINDOWS[0], [alias]).aggregate_names == (entry.name,)
    for alias, name in QUANTILES.aliases.items():
        assert spec_of(WINDOWS[0], [alias]).aggregate_names == (name,)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w.get('kind', 'tumbling')}")
@pytest.mark.parametrize("aggregate", [*AGGREGATES, "p50"])
@settings(max_examples=15, deadline=None)
@given(rows=rows_strategy, cuts=st.lists(st.integers(0, 60), max_size=6), data=st.data())
def test_each_aggregate_alone(
    window: dict[str, Any], aggregate: str, rows: list[Row], cuts: list[int], data: st.DataObject
) -> None:
    spec = spec_of(window, [aggregate])
    batches = split(rows, cuts)
    assert_same(hot_path(spec, batches, data), reference(spec, batches), spec)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w.get('kind', 'tumbling')}")
@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy, cuts=st.lists(st.integers(0, 60), max_size=8), data=st.data())
def test_all_aggregates_together(
    window: dict[str, Any], rows: list[Row], cuts: list[int], data: st.DataObject
) -> None:
    spec = spec_of(window, [*AGGREGATES, "p50", "p99.9"])
    batches = split(rows, cuts)
    assert_same(hot_path(spec, batches, data), reference(spec, batches), spec)
