"""Aggregates as data: per-batch partial expressions, merges and finalisers over polars.

Each aggregate needs some *state fields*; each state field has a partial expression (over the
raw ``ts``/``value`` rows of one group of one batch) and a merge expression (over the state
rows of one group, from any number of partials). Merges are associative and commutative, so
partials from any worker, in any order and batch split, combine to the same state; the
finaliser turns merged state into the output value.

- ``n``, ``sum``, ``min``, ``max``, ``batches``: obvious.
- ``m2`` (sum of squared deviations) merges with Chan et al.'s parallel formula
  ``M2 = sum(M2_i) + sum(n_i * (mean_i - mean)^2)``, stable where sums of squares are not.
- ``first``/``last`` are the value at the smallest/largest event time; ties go to the
  smallest/largest value, so the result never depends on arrival order.
- Quantiles come from the log-bucket sketch in ``sketch.py`` (kept in a separate frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import polars as pl

from shoal.processors.spec import PipelineSpec


@dataclass(frozen=True, slots=True)
class StateField:
    """One column of partial/merged state."""

    name: str
    dtype: pl.DataType
    partial: pl.Expr
    merge: pl.Expr
    needs: tuple[str, ...] = ()


_v, _ts = pl.col("value"), pl.col("ts")

STATE_FIELDS: Final[dict[str, StateField]] = {
    f.name: f
    for f in (
        StateField("n", pl.Int64(), pl.len().cast(pl.Int64), pl.col("n").sum()),
        StateField("batches", pl.Int64(), pl.lit(1, dtype=pl.Int64), pl.col("batches").sum()),
        StateField("sum", pl.Float64(), _v.sum(), pl.col("sum").sum()),
        StateField("min", pl.Float64(), _v.min(), pl.col("min").min()),
        StateField("max", pl.Float64(), _v.max(), pl.col("max").max()),
        StateField(
            "m2",
            pl.Float64(),
            ((_v - _v.mean()) ** 2).sum(),
            pl.col("m2").sum()
            + (
                pl.col("n")
                * (pl.col("sum") / pl.col("n") - pl.col("sum").sum() / pl.col("n").sum()) ** 2
            ).sum(),
            needs=("n", "sum"),
        ),
        StateField("first_ts", pl.Int64(), _ts.min(), pl.col("first_ts").min()),
        StateField(
            "first_value",
            pl.Float64(),
            _v.filter(_ts == _ts.min()).min(),
            pl.col("first_value").filter(pl.col("first_ts") == pl.col("first_ts").min()).min(),
            needs=("first_ts",),
        ),
        StateField("last_ts", pl.Int64(), _ts.max(), pl.col("last_ts").max()),
        StateField(
            "last_value",
            pl.Float64(),
            _v.filter(_ts == _ts.max()).max(),
            pl.col("last_value").filter(pl.col("last_ts") == pl.col("last_ts").max()).max(),
            needs=("last_ts",),
        ),
    )
}

_n = pl.col("n")
FINALISERS: Final[dict[str, tuple[tuple[str, ...], pl.Expr]]] = {
    "count": (("n",), _n),
    "sum": (("sum",), pl.col("sum")),
    "mean": (("n", "sum"), pl.col("sum") / _n),
    "min": (("min",), pl.col("min")),
    "max": (("max",), pl.col("max")),
    # Sample standard deviation (ddof=1), as polars' std(); undefined (null) for one value.
    "stddev": (("n", "m2"), pl.when(_n > 1).then((pl.col("m2") / (_n - 1)).sqrt())),
    "first": (("first_ts", "first_value"), pl.col("first_value")),
    "last": (("last_ts", "last_value"), pl.col("last_value")),
}

ALWAYS: Final = ("n", "batches")
"""Every result carries its row and batch counts."""


@dataclass(frozen=True, slots=True)
class AggregatePlan:
    """What a pipeline computes, compiled to polars expressions once.

    Attributes:
        fields: state fields in dependency order.
        outputs: output column name → finaliser expression (quantiles excluded).
        quantiles: output column name → quantile, computed from the sketch.
    """

    fields: tuple[StateField, ...]
    outputs: dict[str, pl.Expr]
    quantiles: dict[str, float]

    @classmethod
    def for_spec(cls, spec: PipelineSpec) -> AggregatePlan:
        """Compile the aggregates a pipeline spec asks for."""
        wanted: list[str] = list(ALWAYS)
        outputs: dict[str, pl.Expr] = {}
        quantiles: dict[str, float] = {}
        for aggregate in spec.aggregates:
            if aggregate.quantile is not None:
                quantiles[aggregate.name] = aggregate.quantile
                continue
            needs, expr = FINALISERS[aggregate.name]
            wanted.extend(needs)
            outputs[aggregate.name] = expr.alias(aggregate.name)
        ordered: list[str] = []

        def visit(name: str) -> None:
            for dependency in STATE_FIELDS[name].needs:
                visit(dependency)
            if name not in ordered:
                ordered.append(name)

        for name in wanted:
            visit(name)
        return cls(tuple(STATE_FIELDS[n] for n in ordered), outputs, quantiles)

    @property
    def field_names(self) -> tuple[str, ...]:
        """State column names, in order."""
        return tuple(f.name for f in self.fields)

    @property
    def needs_sketch(self) -> bool:
        """Whether any quantile was requested."""
        return bool(self.quantiles)

    def partial_exprs(self) -> list[pl.Expr]:
        """Expressions computing state from raw rows of one group."""
        return [f.partial.alias(f.name) for f in self.fields]

    def merge_exprs(self) -> list[pl.Expr]:
        """Expressions merging state rows of one group."""
        return [f.merge.alias(f.name) for f in self.fields]

    def state_schema(self, groups: dict[str, pl.DataType]) -> pl.Schema:
        """Schema of a state frame with the given group columns."""
        return pl.Schema({**groups, **{f.name: f.dtype for f in self.fields}})
