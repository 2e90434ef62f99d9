"""The oracle: what a pipeline must emit, computed by plain polars over the whole data set.

It knows nothing of partials, workers or combiners: windows come from each window kind's
polars references (``with_window_starts``, and ``emitted_reference`` for which (window, key)
groups are results: a sliding window's trigger) and aggregates from each registry entry's
``reference`` over the raw rows (both checked against plain Python in the unit tests), quantiles
are polars' exact ones. Lateness follows the documented rule: a
row of gateway g's batch s is late when its window ended at least ``lateness_ms +
allowed_lateness_ms`` before the largest event time in g's batches with a smaller seq. Rows
within the allowed lateness count: the oracle is the final (latest) revision of each window.

Session windows (docs/guarantees.md, "Session windows"): a batch's rows of one key form
*pieces* by the session rule (``SessionRule.with_sessions`` over that batch alone); a piece is
late as a whole when ``first_ts + gap_ms + lateness_ms + allowed_lateness_ms`` is at or below
the gateway's earlier watermark; the sessions are ``with_sessions`` over every row that is not
late (the latest revisions, with corrections).

Count windows (``expected_count_results``): each row is judged for lateness as the 1 ms window
at its time (its kind's ``with_window_starts``); the on-time rows of each key, sorted by
(ts, gateway, seq, row), are numbered, and rows ``k*n .. k*n + n - 1`` are window ``k``
(the kind's ``with_count_index``).
"""

from __future__ import annotations

from typing import Final

import polars as pl

from shoal.processors.aggregates import AGGREGATES
from shoal.processors.partials import KeyRouter, session_rule
from shoal.processors.sessions import SessionRule
from shoal.processors.spec import PipelineSpec
from shoal.processors.windows import COUNT, WindowSpec, kind_of


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
    rows = rows.with_columns(_unit=pl.lit(None, dtype=pl.Int64))
    for window in spec.windows:
        rule = session_rule(window)
        if rule is not None:
            frames.append(_session_flags(rows, window, rule, spec, per_batch))
            continue
        frames.append(
            kind_of(window)
            .with_window_starts(rows.with_columns(window=pl.lit(window.name)), window)
            .with_columns(end=pl.col("start") + window.size_ms)
        )
    exploded = pl.concat(frames, how="diagonal").join(
        per_batch, on=["gateway_id", "seq"], how="left"
    )
    if "late" not in exploded.columns:  # no session window
        exploded = exploded.with_columns(late=pl.lit(None, dtype=pl.Boolean))
    return exploded.with_columns(
        late=pl.coalesce(
            "late",
            pl.col("wm_before").is_not_null()
            & (pl.col("end") + spec.lateness_ms + spec.allowed_lateness_ms <= pl.col("wm_before")),
        )
    )


def _session_flags(
    rows: pl.DataFrame,
    window: WindowSpec,
    rule: SessionRule,
    spec: PipelineSpec,
    per_batch: pl.DataFrame,
) -> pl.DataFrame:
    """A session window's rows with ``start``, ``end`` and ``late`` (see the module docstring).

    Late rows carry their piece's ``[first_ts, first_ts + gap_ms)``, on-time rows their
    session's ``[first_ts, last_ts + gap_ms)``.
    """
    piece = pl.concat_str(
        "gateway_id", "seq", pl.col("key").fill_null("\x00"), separator="|"
    ).alias("_piece")
    pieces = (
        rule.with_sessions(rows.with_columns(piece), key="_piece")
        .join(per_batch, on=["gateway_id", "seq"], how="left")
        .with_columns(
            late=pl.col("wm_before").is_not_null()
            & (
                pl.col("start") + rule.gap_ms + spec.lateness_ms + spec.allowed_lateness_ms
                <= pl.col("wm_before")
            ),
            end=pl.col("start") + rule.gap_ms,
            _unit=pl.col("start"),
        )
        .drop("_piece", "wm_before")
    )
    on_time = rule.with_sessions(pieces.filter(~pl.col("late")).drop("start", "end"))
    return pl.concat([on_time, pieces.filter(pl.col("late"))], how="diagonal").with_columns(
        window=pl.lit(window.name)
    )


def closed_by(
    expected: pl.DataFrame, spec: PipelineSpec, threshold: int | list[int | None]
) -> pl.DataFrame:
    """The expected results the partitions close once their close threshold is ``threshold``
    (one for all, or one per partition; None: nothing closed there).

    Aligned windows: those ending at or before it. Sessions: those with ``end + gap_ms`` at
    or before it, published per (partition, window, start) once all of them can close.
    """
    flagged = _flag_closable(expected, spec, threshold)
    return flagged.filter(pl.col("_ok")).drop("_ok", "_partition")


def without_pending_sessions(
    emitted: pl.DataFrame,
    expected: pl.DataFrame,
    spec: PipelineSpec,
    threshold: int | list[int | None],
) -> pl.DataFrame:
    """``emitted`` without the session messages that ``closed_by`` leaves out of ``expected``
    (the full oracle): with corrections, a published session that a late piece extended or
    joined to a session still open is published again only once that session may close, so
    until then its message holds an earlier revision the final threshold cannot judge.
    Without corrections nothing is left out (a session is published only once final)."""
    if not spec.allowed_lateness_ms:
        return emitted
    flagged = _flag_closable(expected, spec, threshold)
    pending = flagged.filter(~pl.col("_ok")).select("window", "start", "_partition").unique()
    if pending.height == 0 or emitted.height == 0:
        return emitted
    router = KeyRouter(spec.partitions)
    return (
        emitted.with_columns(_partition=router.route(emitted["key"]).cast(pl.Int64))
        .join(pending, on=["window", "start", "_partition"], how="anti")
        .drop("_partition")
    )


def _flag_closable(
    expected: pl.DataFrame, spec: PipelineSpec, threshold: int | list[int | None]
) -> pl.DataFrame:
    """``expected`` with ``_partition`` and ``_ok``: whether its (window, start, partition)
    message may close at that partition's threshold (see ``closed_by``)."""
    marks = [threshold] * spec.partitions if isinstance(threshold, int) else threshold
    through = pl.col("_partition").replace_strict(
        dict(enumerate(-(2**62) if m is None else m for m in marks)), return_dtype=pl.Int64
    )
    gaps = {w.name: w.gap_ms for w in spec.windows if w.gap_ms is not None}
    router = KeyRouter(spec.partitions)
    gap = pl.col("window").replace_strict(gaps, default=None, return_dtype=pl.Int64)
    return (
        expected.with_columns(_partition=router.route(expected["key"]).cast(pl.Int64))
        .with_columns(_ok=pl.col("end") + gap.fill_null(0) <= through)
        .with_columns(pl.col("_ok").all().over("window", "start", "_partition"))
    )


_EWM_HALF_LIFE_MS: Final = 10_000.0
_ewm_weight = 2.0 ** ((pl.col("ts") - pl.col("ts").max()) / _EWM_HALF_LIFE_MS)
USER_AGGREGATES: Final[dict[str, pl.Expr]] = {
    # processors/examples/functions/ewm.py, written again over one group's raw rows
    "ewm": (_ewm_weight * pl.col("value")).sum() / _ewm_weight.sum(),
}
"""Plain polars over one group's rows for the user aggregates the tests deploy, by name."""


def _aggregates(spec: PipelineSpec) -> list[pl.Expr]:
    aggs: list[pl.Expr] = [
        pl.len().cast(pl.Int64).alias("rows"),
        # a session's "batches" counts pieces: (batch, first ts of the batch's run), see
        # _session_flags; aligned windows have no ``_unit``.
        pl.struct("gateway_id", "seq", "_unit").n_unique().cast(pl.Int64).alias("batches"),
    ]
    for agg in spec.aggregates:
        if agg.quantile is not None:
            aggs.append(pl.col("value").quantile(agg.quantile, "lower").alias(agg.name))
        elif agg.user is not None:
            aggs.append(USER_AGGREGATES[agg.name].alias(agg.name))
        else:
            aggs.append(AGGREGATES[agg.name].reference.alias(agg.name))
    return aggs


def expected_count_results(
    rows: pl.DataFrame, spec: PipelineSpec, *, threshold: int | None = None, flush: bool = False
) -> tuple[pl.DataFrame, int, pl.DataFrame]:
    """Count windows: (results, late rows, scale), keyed by ``window``, ``index``, ``key``.

    ``rows`` as for ``late_flags`` plus ``row`` (index within its batch). Full windows only,
    and of those only the ones whose last row lies before ``threshold`` (the combiners' close
    threshold) if given; ``flush``: every window, the unfinished ones with fewer rows.
    ``scale`` holds each window's sum of |value| (``compare.assert_matches_oracle``).
    """
    flagged = late_flags(rows, spec)
    on_time = flagged.filter(~pl.col("late"))
    frames, scales = [], []
    for window in spec.windows:
        part = COUNT.with_count_index(on_time.filter(pl.col("window") == window.name), window)
        grouped = part.group_by("window", "key", "index").agg(
            *_aggregates(spec),
            first_ts=pl.col("ts").min(),
            last_ts=pl.col("ts").max(),
            abs_sum=pl.col("value").abs().sum(),
        )
        if not flush:
            grouped = grouped.filter(pl.col("rows") == window.count)
        if threshold is not None and not flush:
            grouped = grouped.filter(pl.col("last_ts") < threshold)
        frames.append(grouped.drop("abs_sum"))
        scales.append(grouped.select("window", "index", "key", "abs_sum"))
    results = pl.concat(frames).sort("window", "key", "index")
    return results, int(flagged["late"].sum()), pl.concat(scales)


def expected_results(rows: pl.DataFrame, spec: PipelineSpec) -> tuple[pl.DataFrame, int]:
    """(results per window/start/key, number of late (row, window) pairs)."""
    flagged = late_flags(rows, spec)
    on_time = flagged.filter(~pl.col("late"))
    per_window = []
    for window in spec.windows:
        emitted = (
            pl.lit(value=True)  # a session is a result whenever it has rows
            if session_rule(window) is not None
            else kind_of(window).emitted_reference(window)
        ).alias("_emitted")
        per_window.append(
            on_time.filter(pl.col("window") == window.name)
            .group_by("window", "start", "end", "key")
            .agg(*_aggregates(spec), emitted)
            .filter(pl.col("_emitted"))
            .drop("_emitted")
        )
    results = pl.concat(per_window).sort("window", "start", "key")
    return results, int(flagged["late"].sum())
