"""The registry of aggregates: each entry is the code that computes it, on every path.

An ``Aggregate`` names the *state fields* it needs, a finaliser (a polars expression over
merged state, run by combiners) and a reference expression over the raw rows of one group
(the oracle of the property tests). A ``StateField`` is one column of partial/merged state
with four definitions of the same thing:

- ``partial_np`` / ``merge_np``: numpy kernels over sorted runs (``_kernels.Runs``), what
  workers (per batch) and combiners (per merge) run;
- ``partial`` / ``merge``: the polars expressions they must agree with, readable, used by
  the tests only.

Merges are associative and commutative, so partials from any worker, in any order and batch
split, combine to the same state.

- ``n``, ``sum``, ``min``, ``max``, ``batches``: obvious.
- ``m2`` (sum of squared deviations) merges with Chan et al.'s parallel formula
  ``M2 = sum(M2_i) + sum(n_i * (mean_i - mean)^2)``, stable where sums of squares are not.
- ``first``/``last`` are the value at the smallest/largest event time; ties go to the
  smallest/largest value, so the result never depends on arrival order.
- Quantiles (``QUANTILES``, names ``pNN``) are a family: their state is the log-bucket
  sketch of ``sketch.py`` (cells of ``(group, bucket) -> count``, carried beside the state
  columns), merged by adding counts.

Imports only ``_kernels`` and ``sketch``; ``spec`` checks names against this registry, never
the reverse. Adding an aggregate: docs/architecture.md, "Adding an aggregate".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.processors._kernels import Runs, quantile_buckets
from shoal.processors.sketch import LogBuckets

Kernel = Callable[[Runs], npt.NDArray[Any]]
"""A state field's numpy kernel: one value per run (group) of sorted rows."""

_DTYPES: Final = {"int": (pl.Int64(), np.dtype("<i8")), "float": (pl.Float64(), np.dtype("<f8"))}


@dataclass(frozen=True, slots=True, eq=False)  # identity: expressions do not compare
class StateField:
    """One column of partial/merged state: its kernels and the polars expressions they mirror.

    Attributes:
        name: the column (also its name on the wire: keep it stable).
        kind: ``int`` (Int64) or ``float`` (Float64), the two types partials carry.
        partial: polars reference over the raw ``ts``/``value`` rows of one group.
        merge: polars reference over the state rows of one group.
        partial_np: numpy kernel computing ``partial`` for every group of a batch.
        merge_np: numpy kernel computing ``merge`` for every group of stacked state.
        needs: fields whose merged values the merge (or the partial) reads; they are computed
            first and travel with this one.
    """

    name: str
    kind: Literal["int", "float"]
    partial: pl.Expr
    merge: pl.Expr
    partial_np: Kernel
    merge_np: Kernel
    needs: tuple[StateField, ...] = ()

    @property
    def dtype(self) -> pl.DataType:
        """The polars dtype of the column."""
        return _DTYPES[self.kind][0]

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the column."""
        return _DTYPES[self.kind][1]


@dataclass(frozen=True, slots=True, eq=False)
class Aggregate:
    """A mergeable aggregate of the ``value`` column: state, finaliser and reference.

    Attributes:
        name: the name pipeline specs use and results carry.
        state: the state fields it reads (their ``needs`` come along).
        finalize: polars expression over merged state columns giving the result.
        reference: polars expression over one group's raw ``ts``/``value`` rows giving the
            same result directly: the oracle of the property tests.
        kind: result type, ``int`` (Int64) or ``float`` (Float64, null where undefined).
        exact: whether the result equals ``reference`` bit for bit whatever the batch split
            and merge order (false where float sums round differently).
        aliases: other names a spec may use for it.
        finalize_eager: computes the result from a frame of merged state columns outside
            polars' evaluation (None: ``finalize`` is evaluated as an expression). A user
            aggregate's ``finalize`` runs under a budget in a thread of its own, which must
            not be waited for on one of polars' threads (its pool may have one).
    """

    name: str
    state: tuple[StateField, ...]
    finalize: pl.Expr
    reference: pl.Expr
    kind: Literal["int", "float"] = "float"
    exact: bool = True
    aliases: tuple[str, ...] = ()
    finalize_eager: Callable[[pl.DataFrame], pl.Series] | None = None

    @property
    def dtype(self) -> pl.DataType:
        """The polars dtype of the result."""
        return _DTYPES[self.kind][0]


_QUANTILE_NAME: Final = re.compile(r"p(\d{1,2}(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class QuantileFamily:
    """Quantiles ``pNN`` (``p50``, ``p99.9``): estimated from the log-bucket sketch.

    The state is the sketch: per group, counts of values per bucket (``LogBuckets``). Workers
    count them per batch (``_kernels.partial_state`` with bucket keys), combiners add counts
    of equal cells (``_kernels.merge_cells``) and ``finalize`` picks each quantile's bucket.
    The ``q`` quantile of ``n`` values is the ``floor(q * (n - 1))``-th smallest; the estimate
    is the representative of its bucket, within the sketch's relative accuracy of it.
    """

    pattern: re.Pattern[str] = _QUANTILE_NAME
    aliases: dict[str, str] = field(default_factory=lambda: {"median": "p50"})

    def parse(self, name: str) -> float | None:
        """The quantile a name asks for, in (0, 1), or None if it is not a quantile name."""
        match = self.pattern.fullmatch(name)
        if match is None:
            return None
        q = float(match.group(1)) / 100.0
        return q if 0.0 < q < 1.0 else None

    def finalize(
        self,
        mapping: LogBuckets,
        cells: npt.NDArray[np.int64],
        counts: npt.NDArray[np.int64],
        groups: npt.NDArray[np.int64],
        quantiles: Sequence[float],
    ) -> list[npt.NDArray[np.float64]]:
        """Estimates per group from merged, sorted sketch cells (every group has cells)."""
        buckets = quantile_buckets(cells, counts, groups, quantiles)
        return [mapping.values_np(b) for b in buckets]

    def reference(self, q: float, mapping: LogBuckets) -> pl.Expr:
        """Polars over one group's raw rows: exactly what ``finalize`` returns."""
        return mapping.value_expr(mapping.key_expr(pl.col("value").quantile(q, "lower")))


# -- the built-in entries ---------------------------------------------------------------------

_v, _ts = pl.col("value"), pl.col("ts")


def _ones(runs: Runs) -> npt.NDArray[np.int64]:
    return np.ones(len(runs.starts), dtype=np.int64)


def _reduce(ufunc: np.ufunc, column: str) -> Kernel:
    """Kernel: ``ufunc`` over each group's ``column``."""
    return lambda runs: runs.reduce(ufunc, column)


def _at_extreme(ufunc: np.ufunc, ts: str, value: str, ts_field: str) -> Kernel:
    """Kernel: ``ufunc`` over the group's ``value`` where ``ts`` equals the merged ``ts_field``.

    The value at the smallest/largest event time; ties broken by the same ``ufunc``.
    """
    fill = np.inf if ufunc is np.minimum else -np.inf

    def kernel(runs: Runs) -> npt.NDArray[Any]:
        if runs.increasing(ts):  # no ties: the value of the group's first (last) row
            return runs.edge(value, ufunc)
        at = runs.columns[ts] == runs.spread(runs.done[ts_field])
        return runs.reduce(ufunc, np.where(at, runs.columns[value], fill))

    return kernel


def _extreme_ts(ufunc: np.ufunc, column: str) -> Kernel:
    """Kernel: the smallest (``np.minimum``) or largest event time of each group's ``column``."""

    def kernel(runs: Runs) -> npt.NDArray[Any]:
        if runs.increasing(column):
            return runs.edge(column, ufunc)
        return runs.reduce(ufunc, column)

    return kernel


def _m2_partial(runs: Runs) -> npt.NDArray[Any]:
    mean = runs.spread(runs.done["sum"] / np.maximum(runs.lengths, 1))
    return runs.reduce(np.add, (runs.columns["value"] - mean) ** 2)


def _m2_merge(runs: Runs) -> npt.NDArray[Any]:
    col = runs.columns
    total_mean = runs.spread(runs.done["sum"] / runs.done["n"])
    spread = col["n"] * (col["sum"] / col["n"] - total_mean) ** 2
    return runs.reduce(np.add, col["m2"] + spread)


def _folded(
    name: str,
    ufunc: np.ufunc,
    fold: Callable[[pl.Expr], pl.Expr],
    *,
    of: Literal["value", "ts"] = "value",
    kind: Literal["int", "float"] = "float",
    kernel: Callable[[np.ufunc, str], Kernel] = _reduce,
) -> StateField:
    """A field that folds one raw column and merges by folding again (sum, min, max, ...).

    ``kernel``: how ``ufunc`` folds a column of each group (``_reduce``; ``_extreme_ts``
    for event times, which usually rise within a group).
    """
    return StateField(
        name,
        kind,
        partial=fold(pl.col(of)),
        merge=fold(pl.col(name)),
        partial_np=kernel(ufunc, of),
        merge_np=kernel(ufunc, name),
    )


def _at_time(
    end: str, ufunc: np.ufunc, pick: Callable[[pl.Expr], pl.Expr]
) -> tuple[StateField, StateField]:
    """``<end>_ts``, the event time ``pick`` of a group, and ``<end>_value``, the value there.

    Ties (several values at that time) go to ``pick`` of the values too.
    """
    ts, value = f"{end}_ts", f"{end}_value"
    at_ts = _folded(ts, ufunc, pick, of="ts", kind="int", kernel=_extreme_ts)
    at_value = StateField(
        value,
        "float",
        partial=pick(_v.filter(_ts == pick(_ts))),
        merge=pick(pl.col(value).filter(pl.col(ts) == pick(pl.col(ts)))),
        partial_np=_at_extreme(ufunc, "ts", "value", ts),
        merge_np=_at_extreme(ufunc, ts, value, ts),
        needs=(at_ts,),
    )
    return at_ts, at_value


N = StateField(
    "n",
    "int",
    partial=pl.len().cast(pl.Int64),
    merge=pl.col("n").sum(),
    partial_np=lambda runs: runs.lengths,
    merge_np=_reduce(np.add, "n"),
)
BATCHES = StateField(
    "batches",
    "int",
    partial=pl.lit(1, dtype=pl.Int64),
    merge=pl.col("batches").sum(),
    partial_np=_ones,
    merge_np=_reduce(np.add, "batches"),
)
PANE_CONTINUED = StateField(
    "continued",
    "int",
    partial=pl.lit(0, dtype=pl.Int64),
    merge=pl.col("continued").sum(),
    partial_np=lambda runs: np.zeros(len(runs.starts), dtype=np.int64),
    merge_np=_reduce(np.add, "continued"),
)
"""A combiner's pane state only (``state.WindowState``, panes of sliding windows): batches
with a row in this pane whose previous pane with a row of the key is the one just before; a
pane's ``batches`` then counts the batches whose run of consecutive panes starts here, so a
window's distinct batches are its panes' ``batches`` plus its first pane's ``continued``.
Not in ``STATE_FIELDS``: never in partials or plans."""
SUM = _folded("sum", np.add, pl.Expr.sum)
MIN = _folded("min", np.minimum, pl.Expr.min)
MAX = _folded("max", np.maximum, pl.Expr.max)
M2 = StateField(
    "m2",
    "float",
    partial=((_v - _v.mean()) ** 2).sum(),
    merge=pl.col("m2").sum()
    + (
        pl.col("n") * (pl.col("sum") / pl.col("n") - pl.col("sum").sum() / pl.col("n").sum()) ** 2
    ).sum(),
    partial_np=_m2_partial,
    merge_np=_m2_merge,
    needs=(N, SUM),
)
FIRST_TS, FIRST_VALUE = _at_time("first", np.minimum, pl.Expr.min)
LAST_TS, LAST_VALUE = _at_time("last", np.maximum, pl.Expr.max)

ALWAYS: Final = (N, BATCHES)
"""Every result carries its row and batch counts."""

_n, _by_time = pl.col("n"), _v.sort_by([_ts, _v])
BUILTIN: Final = (
    Aggregate("count", (N,), _n, pl.len().cast(pl.Int64), kind="int"),
    Aggregate("sum", (SUM,), pl.col("sum"), _v.sum(), exact=False),
    Aggregate("mean", (N, SUM), pl.col("sum") / _n, _v.mean(), exact=False, aliases=("avg",)),
    Aggregate("min", (MIN,), pl.col("min"), _v.min()),
    Aggregate("max", (MAX,), pl.col("max"), _v.max()),
    # Sample standard deviation (ddof=1), as polars' std(); undefined (null) for one value.
    Aggregate(
        "stddev",
        (N, M2),
        pl.when(_n > 1).then((pl.col("m2") / (_n - 1)).sqrt()),
        _v.std(ddof=1),
        exact=False,
        aliases=("std",),
    ),
    Aggregate("first", (FIRST_TS, FIRST_VALUE), pl.col("first_value"), _by_time.first()),
    Aggregate("last", (LAST_TS, LAST_VALUE), pl.col("last_value"), _by_time.last()),
)


# -- the registry ----------------------------------------------------------------------------


def _with_needs(fields: Iterable[StateField]) -> list[StateField]:
    """``fields`` and what they need, each after its needs, in first-seen order."""
    ordered: list[StateField] = []

    def visit(f: StateField) -> None:
        for dependency in f.needs:
            visit(dependency)
        if f not in ordered:
            ordered.append(f)

    for f in fields:
        visit(f)
    return ordered


AGGREGATES: Final[dict[str, Aggregate]] = {a.name: a for a in BUILTIN}
"""Every aggregate a pipeline spec may name (besides quantiles), in a stable order."""

QUANTILES: Final = QuantileFamily()

STATE_FIELDS: Final[dict[str, StateField]] = {
    f.name: f for f in _with_needs([*ALWAYS, *(s for a in BUILTIN for s in a.state)])
}
"""Every state field, in the order partials and merged state carry them (needs first)."""

ALIASES: Final[dict[str, str]] = {
    **{alias: a.name for a in BUILTIN for alias in a.aliases},
    **QUANTILES.aliases,
}
"""Other names of aggregates → their names."""


@dataclass(frozen=True, slots=True)
class AggregateSpec:
    """One requested aggregate: its output name and, for quantiles, the quantile in (0, 1).

    The name is one of ``AGGREGATES``, a quantile name (``QUANTILES``) or a user aggregate
    (``user``: its registry entry, ``user_aggregates.user_aggregate``); pipeline specs
    (``spec.parse_pipeline``) resolve aliases and refuse other names.
    """

    name: str
    quantile: float | None = None
    user: Aggregate | None = field(default=None, compare=False, repr=False)

    @property
    def entry(self) -> Aggregate | None:
        """Its registry entry (None: a quantile)."""
        if self.quantile is not None:
            return None
        return self.user or AGGREGATES[self.name]


@dataclass(frozen=True, slots=True)
class AggregatePlan:
    """What a pipeline computes: the registry entries its aggregates need, resolved once.

    Attributes:
        fields: state fields in registry order (needs first), ``ALWAYS`` included.
        outputs: output column name → finaliser expression (quantiles excluded).
        quantiles: output column name → quantile, computed from the sketch.
        eager: output column name → ``Aggregate.finalize_eager``, for the aggregates that
            have one (``with_eager_outputs`` adds their columns before the outputs' select).
    """

    fields: tuple[StateField, ...]
    outputs: dict[str, pl.Expr]
    quantiles: dict[str, float]
    eager: dict[str, Callable[[pl.DataFrame], pl.Series]] = field(default_factory=dict)

    @classmethod
    def for_aggregates(
        cls, aggregates: Iterable[AggregateSpec], *, last_ts: bool = False
    ) -> AggregatePlan:
        """Resolve the aggregates a pipeline spec asks for (``PipelineSpec.aggregates``).

        ``last_ts``: carry each state's latest event time even if no aggregate asks for it
        (a window kind's trigger reads it: ``PipelineSpec.plan``).
        """
        wanted: list[StateField] = [*ALWAYS, *((LAST_TS,) if last_ts else ())]
        user: list[StateField] = []  # user aggregates' fields follow the registry's
        outputs: dict[str, pl.Expr] = {}
        quantiles: dict[str, float] = {}
        eager: dict[str, Callable[[pl.DataFrame], pl.Series]] = {}
        for requested in aggregates:
            if requested.quantile is not None:
                quantiles[requested.name] = requested.quantile
                continue
            aggregate = requested.user or AGGREGATES[requested.name]
            (wanted if requested.user is None else user).extend(aggregate.state)
            outputs[requested.name] = aggregate.finalize.alias(requested.name)
            if aggregate.finalize_eager is not None:
                eager[requested.name] = aggregate.finalize_eager
        needed = set(_with_needs(wanted))
        fields = tuple(f for f in STATE_FIELDS.values() if f in needed)
        return cls((*fields, *user), outputs, quantiles, eager)

    def with_eager_outputs(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` (merged state columns) with the column of each ``eager`` aggregate."""
        if not self.eager:
            return frame
        if frame.height == 0:  # nothing to finalise: user code is not called for no rows
            return frame.with_columns(pl.lit(None, pl.Float64).alias(name) for name in self.eager)
        return frame.with_columns(
            compute(frame).alias(name) for name, compute in self.eager.items()
        )

    @property
    def field_names(self) -> tuple[str, ...]:
        """State column names, in order."""
        return tuple(f.name for f in self.fields)

    @property
    def needs_sketch(self) -> bool:
        """Whether any quantile was requested."""
        return bool(self.quantiles)

    def partial_exprs(self) -> list[pl.Expr]:
        """Polars reference: state from the raw rows of one group."""
        return [f.partial.alias(f.name) for f in self.fields]

    def merge_exprs(self) -> list[pl.Expr]:
        """Polars reference: merged state from the state rows of one group."""
        return [f.merge.alias(f.name) for f in self.fields]

    def state_schema(self, groups: dict[str, pl.DataType]) -> pl.Schema:
        """Schema of a state frame with the given group columns."""
        return pl.Schema({**groups, **{f.name: f.dtype for f in self.fields}})
