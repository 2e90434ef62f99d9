"""The oracle: what a pipeline must emit, computed by plain polars over the whole data set.

It knows nothing of partials, workers or combiners. Lateness follows the documented rule: a
row of gateway g's batch s is late when its window ended at least ``lateness_ms`` before the
largest event time in g's batches with a smaller seq.
"""

from __future__ import annotations

import polars as pl

from shoal.processors.spec import PipelineSpec


def late_flags(rows: pl.DataFrame, spec: PipelineSpec) -> pl.DataFrame:
    """Explode rows into (window, start) and flag lateness.

    ``rows``: one row per distinct measurement with ``gateway_id``, ``seq``, ``key``, ``ts``,
    ``value`` (duplicated deliveries must already be removed: the oracle counts each once).
    """
    per_batch = (
        rows.group_by("gateway_id", "seq")
        .agg(pl.col("ts").max().alias("batch_max"))
        .sort("gateway_id", "seq")
        .with_columns(pl.col("batch_max").cum_max().shift(1).over("gateway_id").alias("wm_before"))
        .select("gateway_id", "seq", "wm_before")
    )
    frames = []
    for window in spec.windows:
        last = (pl.col("ts") // window.slide_ms) * window.slide_ms
        starts = pl.concat_list([last - j * window.slide_ms for j in range(window.windows_per_row)])
        frames.append(
            rows.with_columns(window=pl.lit(window.name), start=starts)
            .explode("start")
            .with_columns(end=pl.col("start") + window.size_ms)
        )
    exploded = pl.concat(frames).join(per_batch, on=["gateway_id", "seq"], how="left")
    return exploded.with_columns(
        late=pl.col("wm_before").is_not_null()
        & (pl.col("end") + spec.lateness_ms <= pl.col("wm_before"))
    )


def expected_results(rows: pl.DataFrame, spec: PipelineSpec) -> tuple[pl.DataFrame, int]:
    """(results per window/start/key, number of late (row, window) pairs)."""
    flagged = late_flags(rows, spec)
    on_time = flagged.filter(~pl.col("late"))
    aggs: list[pl.Expr] = [
        pl.len().cast(pl.Int64).alias("rows"),
        pl.struct("gateway_id", "seq").n_unique().cast(pl.Int64).alias("batches"),
    ]
    ordered_value = pl.col("value").sort_by(["ts", "value"])
    for agg in spec.aggregates:
        name = agg.name
        if agg.quantile is not None:
            aggs.append(pl.col("value").quantile(agg.quantile, "lower").alias(name))
        else:
            aggs.append(
                {
                    "count": pl.len().cast(pl.Int64),
                    "sum": pl.col("value").sum(),
                    "mean": pl.col("value").mean(),
                    "min": pl.col("value").min(),
                    "max": pl.col("value").max(),
                    "stddev": pl.col("value").std(ddof=1),
                    "first": ordered_value.first(),
                    "last": ordered_value.last(),
                }[name].alias(name)
            )
    results = (
        on_time.group_by("window", "start", "end", "key").agg(aggs).sort("window", "start", "key")
    )
    return results, int(flagged["late"].sum())
