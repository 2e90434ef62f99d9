"""Open windows of one combiner partition: merged partial state, closing and finalising.

Partials are appended cheaply and merged lazily (``compact``): once enough rows are pending,
or when windows close. Merging is a polars group-by with the aggregates' merge expressions,
so state is always exactly "the merge of everything applied", whatever the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import polars as pl

from shoal.processors.aggregates import AggregatePlan
from shoal.processors.sketch import LogBuckets, quantiles_from_buckets
from shoal.processors.spec import PipelineSpec

COMPACT_ROWS: Final = 250_000
"""Pending partial rows that trigger a merge (bounds memory between window closes)."""

GROUPS: Final = ["window", "start", "key"]
_SKETCH_GROUPS: Final = [*GROUPS, "bucket"]


@dataclass(frozen=True, slots=True)
class ClosedWindows:
    """Final results of the windows that closed in one step.

    ``frame`` has ``window`` (name), ``start``, ``end``, ``key``, ``rows``, ``batches`` and
    one column per requested aggregate, sorted by window, start and key.
    """

    frame: pl.DataFrame

    @property
    def empty(self) -> bool:
        """Whether nothing closed."""
        return self.frame.height == 0


class WindowState:
    """Merged state of every open (window, start, key) of one partition."""

    def __init__(self, spec: PipelineSpec, plan: AggregatePlan) -> None:
        self.spec = spec
        self.plan = plan
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self._merge = plan.merge_exprs()
        self._aggs: list[pl.DataFrame] = []
        self._sketch: list[pl.DataFrame] = []
        self._pending_rows = 0
        self._sizes = pl.DataFrame(
            {
                "window": pl.Series(range(len(spec.windows)), dtype=pl.UInt8),
                "size": [w.size_ms for w in spec.windows],
                "name": [w.name for w in spec.windows],
            }
        )

    @property
    def rows(self) -> int:
        """State rows held (merged and pending)."""
        return sum(f.height for f in self._aggs) + sum(f.height for f in self._sketch)

    def add(self, aggs: pl.DataFrame | None, sketch: pl.DataFrame | None) -> None:
        """Append partial state; merged later."""
        if aggs is not None and aggs.height:
            self._aggs.append(aggs)
            self._pending_rows += aggs.height
        if sketch is not None and sketch.height:
            self._sketch.append(sketch)
            self._pending_rows += sketch.height
        if self._pending_rows >= COMPACT_ROWS:
            self.compact()

    def compact(self) -> None:
        """Merge all pending partial state into one frame per kind."""
        if len(self._aggs) > 1:
            merged = pl.concat(self._aggs, how="vertical_relaxed").group_by(GROUPS).agg(self._merge)
            self._aggs = [merged]
        if len(self._sketch) > 1:
            merged = (
                pl.concat(self._sketch, how="vertical_relaxed")
                .group_by(_SKETCH_GROUPS)
                .agg(pl.col("count").sum())
            )
            self._sketch = [merged]
        self._pending_rows = 0

    def open_windows(self) -> int:
        """Distinct (window, start) pairs with state."""
        self.compact()
        if not self._aggs:
            return 0
        return self._aggs[0].select(pl.struct("window", "start").n_unique()).item()  # type: ignore[no-any-return]

    def close(self, through_ms: int) -> ClosedWindows:
        """Finalise and remove every window whose end is at or before ``through_ms``."""
        self.compact()
        if not self._aggs:
            return ClosedWindows(self.empty_result())
        state = self._aggs[0].join(self._sizes, on="window", how="left")
        closing = pl.col("start") + pl.col("size") <= through_ms
        done = state.filter(closing)
        if done.height == 0:
            return ClosedWindows(self.empty_result())
        self._aggs = [state.filter(~closing).drop("size", "name")]
        result = done.select(
            pl.col("name").alias("window"),
            pl.col("window").alias("_window"),
            "start",
            (pl.col("start") + pl.col("size")).alias("end"),
            "key",
            pl.col("n").alias("rows"),
            "batches",
            *self.plan.outputs.values(),
        )
        if self.plan.needs_sketch and self._sketch:
            sketch = self._sketch[0].join(self._sizes, on="window", how="left")
            closing_sketch = sketch.filter(closing)
            self._sketch = [sketch.filter(~closing).drop("size", "name")]
            estimates = quantiles_from_buckets(
                closing_sketch.drop("size", "name"), GROUPS, self.plan.quantiles, self.buckets
            )
            result = result.join(
                estimates.rename({"window": "_window"}),
                on=["_window", "start", "key"],
                how="left",
                nulls_equal=True,
            )
        order = ["window", "start", "end", "key", "rows", "batches", *self.spec.aggregate_names]
        return ClosedWindows(result.select(order).sort("window", "start", "key", nulls_last=True))

    def empty_result(self) -> pl.DataFrame:
        """A results frame with no rows (the schema of every ``ClosedWindows.frame``)."""
        schema: dict[str, pl.DataType] = {
            "window": pl.String(),
            "start": pl.Int64(),
            "end": pl.Int64(),
            "key": pl.String(),
            "rows": pl.Int64(),
            "batches": pl.Int64(),
        }
        for name in self.spec.aggregate_names:
            schema[name] = pl.Int64() if name == "count" else pl.Float64()
        return pl.DataFrame(schema=schema)

    # -- checkpoints -------------------------------------------------------------------------

    def frames(self) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
        """The merged state, for a checkpoint."""
        self.compact()
        return (self._aggs[0] if self._aggs else None, self._sketch[0] if self._sketch else None)

    def restore(self, aggs: pl.DataFrame | None, sketch: pl.DataFrame | None) -> None:
        """Replace the state with a checkpoint's frames."""
        self._aggs = [aggs] if aggs is not None and aggs.height else []
        self._sketch = [sketch] if sketch is not None and sketch.height else []
        self._pending_rows = 0
