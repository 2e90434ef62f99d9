"""compare_results finds missing, extra and different rows, with the documented tolerance."""

from __future__ import annotations

import polars as pl

from shoal.archive import compare_results
from tests.unit.archive.conftest import T0, window_message


def frames() -> pl.DataFrame:
    return pl.concat(
        [
            window_message(start=T0, keys=("a", "b", "c")).frame,
            window_message(start=T0 + 10_000, keys=("a", "b")).frame,
        ]
    )


def test_equal_frames() -> None:
    result = compare_results(frames(), frames().reverse())
    assert result.equal
    assert (result.windows, result.rows) == (2, 5)
    assert result.max_rel_diff["mean"] == 0.0
    assert str(result).startswith("equal: 2 windows, 5 rows")


def test_float_differences_within_and_beyond_tolerance() -> None:
    base = frames()
    close = base.with_columns(pl.col("mean") * (1 + 1e-12))
    assert compare_results(base, close).equal
    far = base.with_columns(
        pl.when(pl.col("key") == "b").then(pl.col("mean") * 1.001).otherwise(pl.col("mean"))
    )
    result = compare_results(base, far)
    assert not result.equal
    assert result.mismatched == 2
    assert result.examples.height == 2
    nulls = base.with_columns(
        pl.when(pl.col("key") == "a").then(None).otherwise(pl.col("p95")).alias("p95")
    )
    assert compare_results(base, nulls).mismatched == 2


def test_counts_must_be_exact_and_rows_must_match() -> None:
    base = frames()
    off_by_one = base.with_columns(
        pl.when(pl.col("key") == "c").then(pl.col("count") + 1).otherwise(pl.col("count"))
    )
    assert compare_results(base, off_by_one).mismatched == 1
    missing = compare_results(base, base.filter(pl.col("key") != "c"))
    assert (missing.missing, missing.extra) == (1, 0)
    later = window_message(start=T0 + 20_000, keys=("z",)).frame
    extra_window = pl.concat([base, later])
    assert compare_results(base, extra_window).equal  # windows only `other` has are ignored
    assert compare_results(base, extra_window, all_windows=True).extra == 1
    extra_key = pl.concat([base, window_message(start=T0, keys=("z",)).frame])
    assert compare_results(base, extra_key).extra == 1
