"""Session windows, worker side: PartialBuilder's pieces, their ``last`` column on the wire.

The spec does not accept ``kind = "session"`` yet (step 4), so these tests put a session
``WindowSpec`` into a parsed spec by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from shoal.errors import ConfigError
from shoal.processors.partials import (
    BatchInfo,
    Partial,
    PartialBuilder,
    spec_fingerprint,
)
from shoal.processors.sessions import SESSION_KIND, SessionRule
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.windows import WindowSpec
from tests.support.datasets import frame_of

ALIGNED: dict[str, Any] = {
    "name": "p",
    "windows": [{"kind": "tumbling", "size_ms": 1_000}],
    "aggregates": ["count", "sum", "min", "max", "first", "last", "p50"],
    "partitions": 3,
}


def session_window(gap_ms: int, max_duration_ms: int | None = None) -> WindowSpec:
    # size/slide are unused by sessions; gap_ms keeps them positive and readable
    return WindowSpec("sess", SESSION_KIND, gap_ms, gap_ms, gap_ms, max_duration_ms)


def with_session(gap_ms: int = 50, max_duration_ms: int | None = None) -> PipelineSpec:
    spec = parse_pipeline(ALIGNED)
    window = session_window(gap_ms, max_duration_ms)
    return dataclasses.replace(spec, windows=(*spec.windows, window))


def info() -> BatchInfo:
    return BatchInfo("gw-1", 0, "s", 0, None, None, 1_000, 2_000, "w1")


def all_rows(partials: list[Partial]) -> pl.DataFrame:
    return pl.concat([p.aggs for p in partials if p.aggs is not None])


rows_strategy = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", "d"]),
        st.one_of(st.integers(0, 600), st.integers(0, 12).map(lambda i: i * 50)),
        st.integers(-5, 5).map(float),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(
    rows=rows_strategy,
    gap=st.sampled_from([1, 25, 50]),
    max_duration=st.sampled_from([None, 100, 250]),
)
def test_session_rows_are_the_batch_sessions_of_the_oracle(
    rows: list[tuple[str, int, float]], gap: int, max_duration: int | None
) -> None:
    spec = with_session(gap, max_duration)
    got = all_rows(PartialBuilder(spec, "w1").build(frame_of(rows), info(), 5_000))
    sessions = got.filter(pl.col("window") == 1).select(
        "key", "start", "last", "n", "sum", "min", "max"
    )
    rule = SessionRule(gap, max_duration)
    frame = pl.DataFrame(
        {"key": [r[0] for r in rows], "ts": [r[1] for r in rows], "value": [r[2] for r in rows]}
    )
    want = (
        rule.with_sessions(frame)
        .group_by("key", "start")
        .agg(
            pl.col("ts").max().alias("last"),
            pl.len().cast(pl.Int64).alias("n"),
            pl.col("value").sum().alias("sum"),
            pl.col("value").min().alias("min"),
            pl.col("value").max().alias("max"),
        )
    )
    assert_frame_equal(sessions.sort("key", "start"), want.sort("key", "start"), check_dtypes=False)


def test_aligned_rows_are_unchanged_and_carry_their_latest_row() -> None:
    rows = [(f"k{i % 5}", 10_000 + 37 * i, float(i)) for i in range(80)]
    plain = all_rows(PartialBuilder(parse_pipeline(ALIGNED), "w1").build(frame_of(rows), info(), 0))
    mixed = all_rows(PartialBuilder(with_session(), "w1").build(frame_of(rows), info(), 0))
    aligned = mixed.filter(pl.col("window") == 0)
    latest = (
        frame_of(rows)
        .select(
            pl.col("sensor_id").alias("key"), (pl.col("ts") // 1_000 * 1_000).alias("start"), "ts"
        )
        .group_by("key", "start")
        .agg(pl.col("ts").max().alias("want"))
    )
    checked = aligned.join(latest, on=["key", "start"], how="left")
    assert (checked["last"] == checked["want"]).all()  # the latest row of each group
    assert_frame_equal(aligned.drop("last").sort("key", "start"), plain.sort("key", "start"))
    assert "last" not in plain.columns


def test_last_survives_the_wire_and_only_session_specs_send_it() -> None:
    rows = [(f"k{i % 7}", 10_000 + 13 * i, float(i)) for i in range(50)]
    for spec, has_last in ((with_session(), True), (parse_pipeline(ALIGNED), False)):
        for p in PartialBuilder(spec, "w1").build(frame_of(rows), info(), 0):
            decoded = Partial.decode(p.encode())
            state = msgpack.unpackb(p.encode(), raw=False)["state"]
            if p.aggs is None:
                assert decoded.aggs is None
                continue
            assert ("last" in state) is has_last
            assert decoded.aggs is not None
            assert_frame_equal(decoded.aggs, p.aggs, check_exact=True)
            if p.sketch is not None:
                assert decoded.sketch is not None
                assert_frame_equal(decoded.sketch, p.sketch, check_exact=True)


def test_fingerprint_covers_the_session_settings() -> None:
    prints = {
        spec_fingerprint(spec)
        for spec in (
            parse_pipeline(ALIGNED),
            with_session(50),
            with_session(51),
            with_session(50, 1_000),
            with_session(50, 2_000),
        )
    }
    assert len(prints) == 5


def test_a_session_window_without_gap_is_a_config_error() -> None:
    spec = parse_pipeline(ALIGNED)
    broken = WindowSpec("sess", SESSION_KIND, 10, 10)
    with pytest.raises(ConfigError, match="gap_ms"):
        PartialBuilder(dataclasses.replace(spec, windows=(broken,)), "w1")
