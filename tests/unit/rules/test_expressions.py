"""Row and result expressions: refused at deploy with the expression and column named; exact."""

from __future__ import annotations

import polars as pl
import pytest

from shoal.errors import ConfigError
from shoal.rules import compile_having, compile_row_rules
from shoal.schemas import FRAME_SCHEMA


def frame(values: list[float], units: list[str | None]) -> pl.DataFrame:
    n = len(values)
    return pl.DataFrame(
        {
            "sensor_id": [f"s{i % 2}" for i in range(n)],
            "ts": list(range(n)),
            "value": values,
            "name": [None] * n,
            "type": [None] * n,
            "unit": units,
        },
        schema=FRAME_SCHEMA,
    )


def test_no_rules_is_none() -> None:
    assert compile_row_rules(None, {}) is None


def test_derive_then_where_filters_and_counts() -> None:
    rules = compile_row_rules(
        "value > 20 AND unit IS NOT NULL",
        {"value": "CASE WHEN unit = 'F' THEN (value - 32) * 5 / 9 ELSE value END"},
    )
    assert rules is not None
    kept = rules.apply(frame([212.0, 25.0, 10.0, 30.0], ["F", "C", "C", None]))
    assert kept.frame["value"].to_list() == [100.0, 25.0]
    assert (kept.filtered, kept.invalid) == (2, 0)  # 10 °C fails; a null unit is not true


def test_derived_columns_are_seen_by_later_expressions_and_where() -> None:
    rules = compile_row_rules("hot", {"celsius": "value - 273.15", "hot": "celsius > 0"})
    assert rules is not None
    kept = rules.apply(frame([300.0, 200.0], ["K", "K"]))
    assert kept.frame["celsius"].round(2).to_list() == [26.85]
    assert kept.filtered == 1


def test_a_derived_value_that_is_not_finite_is_removed_and_counted() -> None:
    rules = compile_row_rules(None, {"value": "1 / (value - 2)"})
    assert rules is not None
    kept = rules.apply(frame([2.0, 3.0], ["C", "C"]))
    assert kept.frame["value"].to_list() == [1.0]
    assert (kept.filtered, kept.invalid) == (0, 1)


def test_the_stage_names_the_batch_columns_it_reads_and_returns_only_those_asked() -> None:
    rules = compile_row_rules(
        "plausible AND type IS NOT NULL",
        {"value": "value * 9 / 5 + 32", "plausible": "value > -60 AND value < 160"},
    )
    assert rules is not None
    assert rules.inputs == {"value", "type"}  # not sensor_id, ts, unit or name
    rows = frame([10.0, 500.0, 20.0], ["C", "C", "C"]).with_columns(type=pl.lit("t"))
    kept = rules.apply(rows, ("ts", "value", "sensor_id"))
    assert kept.frame.columns == ["sensor_id", "ts", "value"]
    assert kept.frame["value"].to_list() == [50.0, 68.0]
    assert (kept.filtered, kept.invalid) == (1, 0)
    assert kept.mask is not None
    assert kept.mask.to_list() == [True, False, True]


@pytest.mark.parametrize(
    ("where", "derive", "field", "reason", "words"),
    [
        ("temp > 30", {}, "where", "unknown_column", "'temp'"),
        ("value >> ", {}, "where", "bad_expression", "cannot parse"),
        ("value + 1", {}, "where", "wrong_type", "true/false"),
        ("sum(value) > 3", {}, "where", "not_per_row", "across rows"),
        ("value > avg(value) OVER (PARTITION BY sensor_id)", {}, "where", "not_per_row", "OVER"),
        # an aggregate compared with a column is spread to every row: its parse tree tells
        ("value > avg(value)", {}, "where", "not_per_row", "AVG(value)"),
        (None, {"v": "value - min(value)"}, "derive.v", "not_per_row", "MIN(value)"),
        ("nope(value) > 1", {}, "where", "unknown_function", "nope()"),
        (None, {"value": "unit"}, "derive.value", "wrong_type", "a number"),
        (None, {"ts": "ts + 1"}, "derive.ts", "protected_column", "identity"),
        (None, {"Bad-Name": "value"}, "derive.Bad-Name", "bad_name", "column name"),
        (None, {"f": "celsius * 2", "celsius": "value"}, "derive.f", "unknown_column", "celsius"),
    ],
)
def test_refusals_name_the_expression_and_the_column(
    where: str | None, derive: dict[str, str], field: str, reason: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_row_rules(where, derive)
    assert (caught.value.field, caught.value.reason) == (field, reason)
    assert words in str(caught.value)
    text = where if where is not None else next(iter(derive.values()))
    assert repr(text) in str(caught.value)


def test_having_over_result_columns() -> None:
    having = compile_having("rows >= 2 AND p95 > 30", {"p95": pl.Float64(), "count": pl.Int64()})
    results = pl.DataFrame({"key": ["a", "b", "c"], "rows": [1, 5, 5], "p95": [40.0, 40.0, None]})
    assert having.apply(results)["key"].to_list() == ["b"]  # a null answer withholds


def test_having_refuses_an_unknown_aggregate_column() -> None:
    with pytest.raises(ConfigError) as caught:
        compile_having("p99 > 3", {"p95": pl.Float64()})
    assert (caught.value.field, caught.value.reason) == ("having", "unknown_column")
    assert "'p99'" in str(caught.value)
