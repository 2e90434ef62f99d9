"""Mergeable aggregates: partial state per chunk, merged in any order, equals a naive oracle."""

from __future__ import annotations

import itertools
import math
import statistics
from fractions import Fraction

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.aggregates import AGGREGATES, STATE_FIELDS, AggregatePlan
from shoal.processors.spec import PipelineSpec, parse_pipeline


def spec_with(aggregates: list[str]) -> PipelineSpec:
    return parse_pipeline(
        {"name": "agg", "windows": [{"size_ms": 1_000}], "aggregates": aggregates}
    )


ALL_SIMPLE = spec_with(list(AGGREGATES))
PLAN = AggregatePlan.for_aggregates(ALL_SIMPLE.aggregates)
SCHEMA = {"key": pl.String, "ts": pl.Int64, "value": pl.Float64}

Row = tuple[str, int, float]


def partial(rows: list[Row]) -> pl.DataFrame:
    frame = pl.DataFrame(rows, schema=SCHEMA, orient="row")
    return frame.group_by("key").agg(PLAN.partial_exprs())


def merge(states: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(states).group_by("key").agg(PLAN.merge_exprs())


def finalise(state: pl.DataFrame) -> dict[str, dict[str, object]]:
    out = state.select("key", "batches", *PLAN.outputs.values())
    return {row.pop("key"): row for row in out.iter_rows(named=True)}


def oracle(rows: list[Row]) -> dict[str, dict[str, object]]:
    """Plain Python over all rows of each key (exact sums via fractions)."""
    by_key: dict[str, list[tuple[int, float]]] = {}
    for key, ts, value in rows:
        by_key.setdefault(key, []).append((ts, value))
    out: dict[str, dict[str, object]] = {}
    for key, pairs in by_key.items():
        values = [v for _, v in pairs]
        first_ts = min(t for t, _ in pairs)
        last_ts = max(t for t, _ in pairs)
        exact_sum = sum(Fraction(v) for v in values)
        out[key] = {
            "count": len(values),
            "sum": float(exact_sum),
            "mean": float(exact_sum / len(values)),
            "min": min(values),
            "max": max(values),
            "stddev": statistics.stdev(values) if len(values) > 1 else None,
            "first": min(v for t, v in pairs if t == first_ts),
            "last": max(v for t, v in pairs if t == last_ts),
            "abs_sum": sum(abs(v) for v in values),
        }
    return out


def assert_matches(got: dict[str, dict[str, object]], rows: list[Row]) -> None:
    want = oracle(rows)
    assert got.keys() == want.keys()
    for key, expected in want.items():
        result = got[key]
        n = expected["count"]
        abs_sum = expected["abs_sum"]
        assert isinstance(n, int)
        assert isinstance(abs_sum, float)
        for name in ("count", "min", "max", "first", "last"):
            assert result[name] == expected[name], (key, name, result[name], expected[name])
        assert math.isclose(result["sum"], expected["sum"], rel_tol=0, abs_tol=1e-9 * abs_sum)  # type: ignore[arg-type]
        assert math.isclose(
            result["mean"],  # type: ignore[arg-type]
            expected["mean"],  # type: ignore[arg-type]
            rel_tol=0,
            abs_tol=1e-9 * abs_sum / n,
        )
        if expected["stddev"] is None:
            assert result["stddev"] is None, (key, result["stddev"])
        else:
            want_sd = expected["stddev"]
            assert isinstance(want_sd, float)
            tol = 1e-7 * max(want_sd, abs_sum / n, 1e-300)
            assert math.isclose(result["stddev"], want_sd, rel_tol=0, abs_tol=tol)  # type: ignore[arg-type]


def chunked(rows: list[Row], cuts: list[int]) -> list[list[Row]]:
    bounds = sorted({0, len(rows), *(min(c, len(rows)) for c in cuts)})
    return [rows[a:b] for a, b in itertools.pairwise(bounds) if b > a]


values = st.one_of(
    # squares of magnitudes below ~1e-154 underflow: no float stddev survives those
    st.floats(-1e6, 1e6).filter(lambda v: v == 0.0 or abs(v) >= 1e-100),
    st.integers(-1_000, 1_000).map(float),
    st.sampled_from([0.0, 20.0, -20.0, 1e6 + 0.5]),
)
rows_strategy = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 20), values),
    min_size=1,
    max_size=80,
)


@settings(max_examples=120, deadline=None)
@given(rows=rows_strategy, cuts=st.lists(st.integers(0, 80), max_size=8), data=st.data())
def test_any_split_any_order_equals_oracle(
    rows: list[Row], cuts: list[int], data: st.DataObject
) -> None:
    chunks = chunked(rows, cuts)
    states = [partial(c) for c in chunks]
    order = data.draw(st.permutations(range(len(states))))
    merged = merge([states[i] for i in order])
    got = finalise(merged)
    assert_matches(got, rows)
    # "batches" counts the chunks a key appeared in
    for key, result in got.items():
        assert result["batches"] == sum(any(r[0] == key for r in c) for c in chunks)


@settings(max_examples=80, deadline=None)
@given(rows=rows_strategy, cuts=st.lists(st.integers(0, 80), max_size=8), data=st.data())
def test_merge_of_merges(rows: list[Row], cuts: list[int], data: st.DataObject) -> None:
    states = [partial(c) for c in chunked(rows, cuts)]
    split = data.draw(st.integers(0, len(states)))
    groups = [g for g in (states[:split], states[split:]) if g]
    merged_groups = [merge(g) for g in groups]
    # merging an already merged state again (alone, or with the other half) changes nothing
    once = merge(merged_groups)
    twice = merge([merge([m]) for m in merged_groups])
    assert_matches(finalise(once), rows)
    assert_matches(finalise(twice), rows)


@settings(max_examples=80, deadline=None)
@given(rows=rows_strategy)
def test_reference_expressions_equal_the_oracle(rows: list[Row]) -> None:
    """The registry's references (test_registry's oracle) against plain Python."""
    frame = pl.DataFrame(rows, schema=SCHEMA, orient="row")
    got = frame.group_by("key").agg(a.reference.alias(a.name) for a in AGGREGATES.values())
    assert_matches({row.pop("key"): row for row in got.iter_rows(named=True)}, rows)


@pytest.mark.parametrize(
    ("rows", "first", "last"),
    [
        # ties at the earliest/latest ts: smallest first, largest last, whatever the order
        ([("k", 5, 3.0), ("k", 5, 1.0), ("k", 9, 2.0), ("k", 9, 7.0)], 1.0, 7.0),
        ([("k", 9, 7.0), ("k", 9, 2.0), ("k", 5, 1.0), ("k", 5, 3.0)], 1.0, 7.0),
        ([("k", 5, -1.0), ("k", 5, -3.0)], -3.0, -1.0),
        ([("k", 0, 4.0)], 4.0, 4.0),
    ],
)
def test_first_last_tie_breaks(rows: list[Row], first: float, last: float) -> None:
    for split in range(len(rows) + 1):
        for chunks in ([rows[:split], rows[split:]], [rows[split:], rows[:split]]):
            result = finalise(merge([partial(c) for c in chunks if c]))["k"]
            assert (result["first"], result["last"]) == (first, last)


def test_stddev_is_null_for_one_value_and_sample_otherwise() -> None:
    one = finalise(merge([partial([("k", 0, 5.0)])]))["k"]
    assert one["stddev"] is None
    # two partials of one value each: n = 2, sample stddev of (1, 3) = sqrt(2)
    two = finalise(merge([partial([("k", 0, 1.0)]), partial([("k", 1, 3.0)])]))["k"]
    assert two["stddev"] == pytest.approx(math.sqrt(2.0), rel=1e-12)


def test_stddev_is_stable_for_large_offsets() -> None:
    """Chan's merge keeps precision where a sum of squares would cancel catastrophically."""
    base = 1e9
    rows: list[Row] = [("k", i, base + d) for i, d in enumerate([0.1, 0.2, 0.3, 0.4] * 5)]
    got = finalise(merge([partial(rows[i : i + 3]) for i in range(0, len(rows), 3)]))["k"]
    want = statistics.stdev([r[2] for r in rows])
    assert got["stddev"] == pytest.approx(want, rel=1e-6)


# -- the plan ----------------------------------------------------------------------------------


def assert_dependency_order(plan: AggregatePlan) -> None:
    names = plan.field_names
    assert len(set(names)) == len(names)
    assert names[:2] == ("n", "batches")
    for index, field in enumerate(plan.fields):
        for dependency in field.needs:
            assert dependency.name in names[:index], (field.name, dependency.name, names)


@pytest.mark.parametrize(
    ("aggregates", "fields"),
    [
        (["count"], ("n", "batches")),
        (["sum"], ("n", "batches", "sum")),
        (["mean"], ("n", "batches", "sum")),
        (["stddev"], ("n", "batches", "sum", "m2")),
        (["min", "max"], ("n", "batches", "min", "max")),
        (["last"], ("n", "batches", "last_ts", "last_value")),
        (["first", "p50"], ("n", "batches", "first_ts", "first_value")),
        (["p99"], ("n", "batches")),
        (
            list(AGGREGATES),
            (
                "n",
                "batches",
                "sum",
                "min",
                "max",
                "m2",
                "first_ts",
                "first_value",
                "last_ts",
                "last_value",
            ),
        ),
    ],
)
def test_plan_fields_in_dependency_order(aggregates: list[str], fields: tuple[str, ...]) -> None:
    plan = AggregatePlan.for_aggregates(spec_with(aggregates).aggregates)
    assert plan.field_names == fields
    assert_dependency_order(plan)


@pytest.mark.parametrize("name", list(AGGREGATES))
def test_every_aggregate_alone(name: str) -> None:
    plan = AggregatePlan.for_aggregates(spec_with([name]).aggregates)
    assert_dependency_order(plan)
    assert {f.name for f in AGGREGATES[name].state} <= set(plan.field_names)
    assert list(plan.outputs) == [name]
    assert plan.quantiles == {}
    assert not plan.needs_sketch


def test_quantiles_go_to_the_sketch() -> None:
    plan = AggregatePlan.for_aggregates(spec_with(["p50", "mean", "p99.9"]).aggregates)
    assert plan.quantiles == {"p50": 0.5, "p99.9": pytest.approx(0.999)}
    assert list(plan.outputs) == ["mean"]
    assert plan.needs_sketch


def test_state_schema() -> None:
    plan = AggregatePlan.for_aggregates(spec_with(["stddev", "last"]).aggregates)
    schema = plan.state_schema({"key": pl.String()})
    assert schema.names() == ["key", *plan.field_names]
    assert {name: schema[name] for name in plan.field_names} == {
        name: STATE_FIELDS[name].dtype for name in plan.field_names
    }


def test_partial_state_has_the_declared_dtypes() -> None:
    plan = AggregatePlan.for_aggregates(ALL_SIMPLE.aggregates)
    state = partial([("a", 1, 1.0), ("a", 2, 2.0)])
    merged = merge([state, state])
    for frame in (state, merged):
        assert frame.schema == plan.state_schema({"key": pl.String()})
