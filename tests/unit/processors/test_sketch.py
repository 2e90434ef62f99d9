"""The log-bucket sketch: key mapping, representatives, and quantiles against polars' exact ones."""

from __future__ import annotations

import itertools
import math

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import UsageError
from shoal.processors.sketch import (
    MIN_INDEXABLE,
    LogBuckets,
    quantile_rank,
    quantiles_from_buckets,
)

accuracies = st.floats(0.001, 0.1)
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)
interesting = st.one_of(
    finite,
    st.sampled_from([0.0, -0.0, MIN_INDEXABLE, -MIN_INDEXABLE, 2e-9, -2e-9, 1.0, -1.0]),
    st.floats(-1e-8, 1e-8),
)
QUANTILES = [0.001, 0.01, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999]


def keys_of(mapping: LogBuckets, values: list[float]) -> list[int]:
    frame = pl.DataFrame({"v": values}, schema={"v": pl.Float64})
    return frame.select(mapping.key_expr(pl.col("v"))).to_series().to_list()


def values_of(mapping: LogBuckets, keys: list[int]) -> list[float]:
    frame = pl.DataFrame({"k": keys}, schema={"k": pl.Int32})
    return frame.select(mapping.value_expr(pl.col("k"))).to_series().to_list()


def within_bound(estimate: float, exact: float, accuracy: float) -> bool:
    return abs(estimate - exact) <= accuracy * abs(exact) * (1 + 1e-9) + MIN_INDEXABLE


@pytest.mark.parametrize("accuracy", [0.0, 1.0, -0.01, 1.5])
def test_refuses_nonsense_accuracy(accuracy: float) -> None:
    with pytest.raises(UsageError, match="relative_accuracy"):
        LogBuckets(accuracy)


def test_key_layout() -> None:
    mapping = LogBuckets(0.01)
    assert mapping.key_of(0.0) == 0
    assert mapping.key_of(MIN_INDEXABLE) == 0
    assert mapping.key_of(-MIN_INDEXABLE) == 0
    smallest = mapping.key_of(MIN_INDEXABLE * 1.0001)
    assert smallest >= 1
    assert mapping.key_of(-MIN_INDEXABLE * 1.0001) == -smallest
    assert mapping.key_of(1.0) == mapping.bias  # log(1) = 0: bucket index 0
    assert mapping.value_of(0) == 0.0
    assert mapping.value_of(mapping.bias) == pytest.approx(2 / (mapping.gamma + 1))


@settings(max_examples=100, deadline=None)
@given(accuracy=accuracies, values=st.lists(interesting, max_size=40))
def test_polars_and_python_mappings_agree(accuracy: float, values: list[float]) -> None:
    mapping = LogBuckets(accuracy)
    keys = keys_of(mapping, values)
    assert keys == [mapping.key_of(v) for v in values]
    # Representatives agree to the last bit or two (polars' pow and Python's may round apart).
    for got, key in zip(values_of(mapping, keys), keys, strict=True):
        assert math.isclose(got, mapping.value_of(key), rel_tol=1e-15, abs_tol=0.0)


@settings(max_examples=100, deadline=None)
@given(accuracy=accuracies, values=st.lists(interesting, min_size=2, max_size=40))
def test_keys_sort_like_values(accuracy: float, values: list[float]) -> None:
    mapping = LogBuckets(accuracy)
    ordered = sorted(values)
    keys = keys_of(mapping, ordered)
    assert keys == sorted(keys)
    # Representatives are monotone in the key as well, strictly between distinct keys.
    for k1, k2 in itertools.pairwise(keys):
        if k1 < k2:
            assert mapping.value_of(k1) < mapping.value_of(k2)


def test_keys_sort_like_values_across_zero() -> None:
    mapping = LogBuckets(0.02)
    values = [-1e300, -5.0, -1.0, -0.5, -2e-9, -1e-9, 0.0, 1e-9, 2e-9, 0.5, 1.0, 5.0, 1e300]
    keys = [mapping.key_of(v) for v in values]
    assert keys == sorted(keys)
    assert keys[5:8] == [0, 0, 0]
    assert len(set(keys)) == len(values) - 2
    assert all(k < 0 for k in keys[:5])
    assert all(k > 0 for k in keys[8:])


@settings(max_examples=300, deadline=None)
@given(
    accuracy=accuracies,
    exponent=st.floats(-8.0, 300.0),
    negative=st.booleans(),
)
def test_representative_within_relative_accuracy(
    accuracy: float, exponent: float, negative: bool
) -> None:
    mapping = LogBuckets(accuracy)
    value = (-1.0 if negative else 1.0) * 10.0**exponent
    estimate = mapping.value_of(mapping.key_of(value))
    assert abs(estimate - value) <= accuracy * abs(value) * (1 + 1e-9)
    [polars_estimate] = values_of(mapping, keys_of(mapping, [value]))
    assert abs(polars_estimate - value) <= accuracy * abs(value) * (1 + 1e-9)


@pytest.mark.parametrize("accuracy", [0.001, 0.01, 0.1])
def test_bucket_bounds_are_exact_powers(accuracy: float) -> None:
    """A value on a bucket's upper bound belongs to it and is still within the accuracy."""
    mapping = LogBuckets(accuracy)
    for index in (-50, -1, 0, 1, 7, 300):
        edge = mapping.gamma**index
        key = mapping.key_of(edge)
        assert abs(mapping.value_of(key) - edge) <= accuracy * edge * (1 + 1e-9)


# -- quantiles ---------------------------------------------------------------------------------


def buckets_of(mapping: LogBuckets, groups: list[str], values: list[float]) -> pl.DataFrame:
    frame = pl.DataFrame({"g": groups, "v": values}, schema={"g": pl.String, "v": pl.Float64})
    return frame.group_by("g", mapping.key_expr(pl.col("v")).alias("bucket")).agg(
        count=pl.len().cast(pl.Int64)
    )


def sketch_quantiles(
    mapping: LogBuckets, buckets: pl.DataFrame, quantiles: list[float]
) -> dict[str, dict[float, float]]:
    names = {f"q{i}": q for i, q in enumerate(quantiles)}
    out = quantiles_from_buckets(buckets, ["g"], names, mapping)
    return {
        row["g"]: {q: row[name] for name, q in names.items()} for row in out.iter_rows(named=True)
    }


def exact_quantiles(
    groups: list[str], values: list[float], quantiles: list[float]
) -> dict[str, dict[float, float]]:
    frame = pl.DataFrame({"g": groups, "v": values}, schema={"g": pl.String, "v": pl.Float64})
    out: dict[str, dict[float, float]] = {}
    for (group,), rows in frame.group_by("g"):
        assert isinstance(group, str)
        out[group] = {q: rows["v"].quantile(q, "lower") for q in quantiles}  # type: ignore[misc]
    return out


def check_against_polars(accuracy: float, groups: list[str], values: list[float]) -> None:
    mapping = LogBuckets(accuracy)
    got = sketch_quantiles(mapping, buckets_of(mapping, groups, values), QUANTILES)
    want = exact_quantiles(groups, values, QUANTILES)
    assert got.keys() == want.keys()
    for group, by_q in want.items():
        for q, exact in by_q.items():
            assert within_bound(got[group][q], exact, accuracy), (group, q, got[group][q], exact)


@pytest.mark.parametrize(
    "values",
    [
        [42.0],
        [-3.5],
        [0.0],
        [1.0, 2.0],
        [2.0, 1.0],
        [-1.0, 1.0],
        [1.0, 2.0, 3.0],
        [3.0, -3.0, 0.0],
        [5.0, 5.0, 5.0],
        [1e-12, 1.0, 1e12],
    ],
)
def test_small_samples(values: list[float]) -> None:
    check_against_polars(0.01, ["g"] * len(values), values)


def test_rank_is_polars_lower_interpolation() -> None:
    """The rank the sketch uses picks exactly polars' ``lower`` quantile, for every n and q."""
    for n in range(1, 60):
        values = pl.Series([float(i) for i in range(n)])
        ranks = (
            pl.DataFrame({"n": [n]})
            .select(quantile_rank(q, pl.col("n")).alias(str(q)) for q in QUANTILES)
            .row(0)
        )
        for q, rank in zip(QUANTILES, ranks, strict=True):
            assert values.quantile(q, "lower") == float(rank), (n, q)


@settings(max_examples=60, deadline=None)
@given(
    accuracy=accuracies,
    data=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.one_of(
                st.floats(-1e6, 1e6),
                st.sampled_from([0.0, 1.0, -1.0, 20.5]),  # ties
                st.floats(1e-12, 1e-6),
            ),
        ),
        min_size=1,
        max_size=200,
    ),
)
def test_quantiles_within_bound_of_exact(accuracy: float, data: list[tuple[str, float]]) -> None:
    check_against_polars(accuracy, [g for g, _ in data], [v for _, v in data])


@settings(max_examples=60, deadline=None)
@given(
    accuracy=accuracies,
    values=st.lists(st.floats(-1e9, 1e9), min_size=1, max_size=150),
    cuts=st.lists(st.integers(0, 150), max_size=6),
)
def test_merging_split_bucket_counts_is_exact(
    accuracy: float, values: list[float], cuts: list[int]
) -> None:
    mapping = LogBuckets(accuracy)
    bounds = sorted({0, len(values), *(min(c, len(values)) for c in cuts)})
    chunks = [values[a:b] for a, b in itertools.pairwise(bounds)]
    partial_counts = [buckets_of(mapping, ["g"] * len(c), c) for c in chunks if c]
    merged = pl.concat(partial_counts).group_by("g", "bucket").agg(pl.col("count").sum())
    direct = buckets_of(mapping, ["g"] * len(values), values)
    assert sketch_quantiles(mapping, merged, QUANTILES) == sketch_quantiles(
        mapping, direct, QUANTILES
    )


def test_representatives_are_the_same_bits_on_every_path() -> None:
    # np.power is dispatched to CPU-specific SIMD kernels that may round the last bit
    # differently from machine to machine; the published quantile must not depend on that.
    mapping = LogBuckets(0.01)
    keys = np.arange(-3000, 3000, 7, dtype=np.int64)
    table = mapping.values_np(keys)
    scalar = [mapping.value_of(int(k)) for k in keys]
    polars = pl.select(mapping.value_expr(pl.lit(pl.Series(keys)))).to_series().to_list()
    for key, got, one, expr in zip(keys, table, scalar, polars, strict=True):
        if key == 0:
            continue
        formula = 2.0 * mapping.gamma ** (abs(int(key)) - mapping.bias) / (mapping.gamma + 1.0)
        assert got == one == math.copysign(formula, key)
        # polars raises to an integer power by multiplication: the reference, within 1e-12
        assert math.isclose(expr, got, rel_tol=1e-12)
    top = mapping.values_np(np.array([mapping.key_of(1.7e308)]))
    assert math.isfinite(top[0])
    assert top[0] >= 1.7e308
