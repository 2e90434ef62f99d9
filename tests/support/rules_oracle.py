"""The rules oracle: ``derive``, ``where``, ``having`` and alerts in plain polars and Python.

Per row, over the whole data set: the derive expressions (``pl.sql_expr``, in order), then
rows whose value is null or not finite and rows failing ``where`` are counted and dropped;
lateness is judged as in ``oracle.late_flags`` with each batch's watermark over *all* its
rows (the documented rule: event time follows every row a gateway sent). ``having`` filters
the results; alerts are a plain loop over each key's results in start order.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import polars as pl

from shoal.processors.spec import PipelineSpec, inline_function_files
from shoal.schemas import Encoding
from tests.support.compare import assert_matches_oracle
from tests.support.datasets import GeneratedBatch
from tests.support.live import Collected, InProcessPipeline, run_live
from tests.support.oracle import _aggregates, late_flags

RULES: Final = {
    "derive": {
        "value": "CASE WHEN unit = 'F' THEN (value - 32) * 5 / 9 ELSE value END",
        "plausible": "value > -10 AND value < 45",
    },
    "where": "plausible AND sensor_id <> 'shared-k0'",
    "having": "rows >= 3",
    "alerts": [{"name": "hot", "condition": "max > 30", "for": 2, "resolve": "max < 25"}],
}
"""Rules over ``with_attributes`` data whose conditions read exact aggregates only (rows,
max), so no float rounding decides a comparison: Fahrenheit to Celsius, implausible
readings and one sensor dropped, keys with fewer than 3 rows withheld, and an alert after two
consecutive windows above 30 °C that resolves below 25 °C."""


@dataclass(frozen=True)
class RulesExpectation:
    """What a pipeline with rules must publish and count."""

    results: pl.DataFrame
    """Closed results before ``having`` (what alerts see)."""
    published: pl.DataFrame
    """Results passing ``having``."""
    filtered: int
    """Rows removed by the row stage (each row once)."""
    late: int
    scale: pl.DataFrame


_CURVE: Final = (2.0e-5, -1.5e-3, 1.02, -0.4)
_READ: Final = (-20.0, 0.0, 10.0, 20.0, 30.0, 50.0)
_TRUE: Final = (-19.6, 0.3, 10.1, 19.8, 29.5, 49.0)


def _table(reading: pl.Expr) -> pl.Expr:
    """The correction table of ``udf-in-sql.toml``: linear between its points."""
    return reading.map_batches(
        lambda s: pl.Series(np.interp(s.to_numpy(), _READ, _TRUE)), return_dtype=pl.Float64
    )


USER_FUNCTIONS: Final[dict[str, pl.Expr]] = {
    # processors/examples/udf.toml's functions, written again as plain polars expressions
    "calibrate(value)": (
        ((_CURVE[0] * pl.col("value") + _CURVE[1]) * pl.col("value") + _CURVE[2]) * pl.col("value")
        + _CURVE[3]
    ),
    "plausible(value, unit)": pl.when(pl.col("unit") == "F")
    .then(pl.col("value").is_between(14.0, 104.0))
    .otherwise(pl.col("value").is_between(-10.0, 40.0)),
    # processors/examples/udf-in-sql.toml's expressions, UDF calls inside SQL, in plain polars
    "CASE WHEN unit = 'F' THEN correct((value - 32) * 5 / 9) ELSE correct(value) END": (
        pl.when(pl.col("unit") == "F")
        .then(_table((pl.col("value") - 32) * 5 / 9))
        .otherwise(_table(pl.col("value")))
    ),
    "plausible(value, 'C') AND sensor_id <> 'shared-k0'": (
        pl.col("value").is_between(-10.0, 40.0) & (pl.col("sensor_id") != "shared-k0")
    ),
}
"""UDF calls the tests deploy, by their text in ``derive``/``where``, in plain polars."""


EXAMPLES: Final = Path(__file__).resolve().parents[2] / "processors" / "examples"


def example_functions() -> dict[str, Any]:
    """``functions``, ``derive`` and ``where`` of the UDF and UDAF examples, merged: spec keys
    that calibrate (UDF in derive), drop implausible readings (bool UDF as where) and offer
    the ``ewm`` aggregate (UDAF)."""
    udf = tomllib.loads((EXAMPLES / "udf.toml").read_text())
    udaf = inline_function_files(tomllib.loads((EXAMPLES / "udaf-ewm.toml").read_text()), EXAMPLES)
    return {
        "functions": {**udf["functions"], **udaf["functions"]},
        "derive": udf["derive"],
        "where": udf["where"],
    }


def example_rules(file: str) -> dict[str, Any]:
    """``functions``, ``derive`` and ``where`` of the example ``processors/examples/<file>``."""
    raw = inline_function_files(tomllib.loads((EXAMPLES / file).read_text()), EXAMPLES)
    return {k: raw[k] for k in ("functions", "derive", "where") if k in raw}


def _expression(text: str) -> pl.Expr:
    return USER_FUNCTIONS[text] if text in USER_FUNCTIONS else pl.sql_expr(text)


def row_stage(rows: pl.DataFrame, spec: PipelineSpec) -> tuple[pl.DataFrame, pl.Series]:
    """``rows`` with the derived columns, and per row whether it is kept."""
    out = rows
    for name, text in spec.derive:
        out = out.with_columns(_expression(text).alias(name))
    keep = out["value"].is_not_null() & out["value"].cast(pl.Float64).is_finite()
    if spec.where is not None:
        keep = keep & out.select(_expression(spec.where).fill_null(value=False)).to_series()
    return out.with_columns(pl.col("value").cast(pl.Float64)), keep.fill_null(value=False)


def expected_with_rules(rows: pl.DataFrame, spec: PipelineSpec) -> RulesExpectation:
    """``rows``: every row once with gateway_id, seq, key, ts, value and the columns the
    rules name."""
    derived, keep = row_stage(rows, spec)
    flagged = late_flags(derived.with_columns(__keep=keep), spec)
    kept = flagged.filter(pl.col("__keep"))
    on_time = kept.filter(~pl.col("late"))
    results = (
        on_time.group_by("window", "start", "end", "key")
        .agg(_aggregates(spec))
        .sort("window", "start", "key")
    )
    published = results if spec.having is None else results.filter(pl.sql_expr(spec.having))
    scale = on_time.group_by("window", "start", "key").agg(abs_sum=pl.col("value").abs().sum())
    return RulesExpectation(results, published, int((~keep).sum()), int(kept["late"].sum()), scale)


@dataclass(frozen=True)
class RulesRun:
    """What ``run_rules_against_oracle`` saw and expected."""

    pipeline: InProcessPipeline
    seen: Collected
    want: RulesExpectation
    closed: pl.Expr
    """Windows the run closed (``end`` at or before the common close threshold)."""


async def run_rules_against_oracle(
    spec: PipelineSpec, batches: list[GeneratedBatch], order: list[int], **live: Any
) -> RulesRun:
    """``live.run_live`` (``live``: its keywords; binary columnar unless ``encoding`` says
    otherwise), then: the closed results, late rows and every partition's filtered count are
    the rules oracle's, and the row stage removed rows."""
    pipeline, seen, threshold = await run_live(
        spec, batches, order, **{"encoding": Encoding.BINARY_COLUMNAR, **live}
    )
    want = expected_with_rules(rows_of(batches), spec)
    closed = pl.col("end") <= threshold
    assert want.filtered > 0
    assert want.published.filter(closed).height > 0
    assert_matches_oracle(seen.results_frame(), want.published.filter(closed), spec, want.scale)
    assert sum(item["rows"] for item in seen.late) == want.late
    for c in pipeline.combiners:  # every partition sees every batch: each counts all filtered
        assert c.core.counters.rows_filtered == want.filtered
    return RulesRun(pipeline, seen, want, closed)


def expected_transitions(results: pl.DataFrame, spec: PipelineSpec) -> set[tuple]:
    """(alert, key, start, state) of every transition the alerts must make."""
    out: set[tuple] = set()
    for alert in spec.alerts:
        mine = results.filter(pl.col("window") == alert.window).with_columns(
            met=pl.sql_expr(alert.condition).fill_null(value=False),
            resolves=pl.sql_expr(alert.resolve or f"NOT ({alert.condition})").fill_null(
                value=False
            ),
        )
        for (key,), group in mine.sort("start").group_by("key", maintain_order=True):
            streak, firing = 0, False
            for row in group.iter_rows(named=True):
                if firing:
                    if row["resolves"]:
                        firing, streak = False, 0
                        out.add((alert.name, key, row["start"], "resolved"))
                elif row["met"]:
                    streak += 1
                    if streak >= alert.for_windows:
                        firing = True
                        out.add((alert.name, key, row["start"], "firing"))
                else:
                    streak = 0
    return out


def with_attributes(batches: list[GeneratedBatch], seed: int) -> list[GeneratedBatch]:
    """The batches with attributes per row: ``type`` temperature or noise, ``unit`` C or F
    (a third in Fahrenheit, their values converted to it)."""
    rng = np.random.default_rng(seed)
    out = []
    for batch in batches:
        n = batch.frame.height
        fahrenheit = pl.Series(rng.random(n) < 0.33)
        noise = pl.Series(rng.random(n) < 0.25)
        frame = batch.frame.with_columns(
            type=pl.when(noise).then(pl.lit("noise")).otherwise(pl.lit("temperature")),
            unit=pl.when(fahrenheit).then(pl.lit("F")).otherwise(pl.lit("C")),
            value=pl.when(fahrenheit)
            .then((pl.col("value") * 9 / 5 + 32).round(3))
            .otherwise(pl.col("value")),
        )
        out.append(GeneratedBatch(batch.gateway_id, batch.seq, frame))
    return out


def rows_of(batches: list[GeneratedBatch], key: str = "sensor_id") -> pl.DataFrame:
    """Every row once with all its columns, ``key``, ``gateway_id`` and ``seq``."""
    return pl.concat(
        b.frame.with_columns(
            key=pl.col(key),
            gateway_id=pl.lit(b.gateway_id),
            seq=pl.lit(b.seq, dtype=pl.Int64),
        )
        for b in batches
    )
