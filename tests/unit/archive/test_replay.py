"""Replay without a broker: archived bytes through the real decode and aggregation code."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from shoal.archive import compare_results, replay
from shoal.archive.records import batch_row
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.schemas import Encoding, Measurements, encode_batch
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import GeneratedBatch, all_rows, make_batches, two_window_spec
from tests.support.in_memory import run_in_memory, shuffled_with_duplicates
from tests.support.oracle import expected_results

AGGREGATES = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50", "p95", "p99"]


def spec_for(partitions: int = 1) -> PipelineSpec:
    return two_window_spec("replayed", AGGREGATES, partitions)


def archived(
    batches: list[GeneratedBatch],
    *,
    seed: int,
    encoding: Encoding = Encoding.BINARY_COLUMNAR,
    duplicate_fraction: float = 0.25,
    stream: str = "s",
) -> pl.DataFrame:
    """What an archive holds after a run: shuffled receive order, re-sent copies."""
    rng = np.random.default_rng(seed)
    order = shuffled_with_duplicates(len(batches), rng, duplicate_fraction)
    rows = []
    for n, index in enumerate(order):
        batch = batches[index]
        block = (
            Measurements.from_frame(batch.frame)
            if encoding is Encoding.BINARY_COLUMNAR
            else batch.frame
        )
        payload = encode_batch(
            block, gateway_id=batch.gateway_id, seq=batch.seq, sent_at_ms=0, encoding=encoding
        )
        topic = f"ingest/{stream}/{batch.gateway_id}"
        rows.append(batch_row(topic, payload, encoding.content_type, 1_700_000_000_000 + n))
    return pl.concat(rows).with_columns(pl.lit(stream).alias("stream"))


@pytest.mark.parametrize(
    ("partitions", "encoding"),
    [(1, Encoding.BINARY_COLUMNAR), (2, Encoding.JSON_ROWS), (3, Encoding.MSGPACK_ROWS)],
)
def test_replay_equals_the_oracle(partitions: int, encoding: Encoding) -> None:
    spec = spec_for(partitions)
    batches = make_batches(seed=partitions, batches_per_gateway=15, rows_per_batch=(0, 60))
    result = replay(spec, archived(batches, seed=partitions, encoding=encoding))
    rows = all_rows(batches)
    expected, late_count = expected_results(rows, spec)
    # replay flushes at the end: every window of the data set is emitted
    assert_matches_oracle(result.results, expected, spec, scale_of(rows, spec))
    assert result.report.rows_late == late_count > 0
    assert int(result.late["rows"].sum()) == late_count
    assert result.report.duplicates > 0
    assert result.report.batches_applied == len(batches)
    assert result.report.gaps == {}


def test_replay_is_deterministic_under_any_receive_order() -> None:
    spec = spec_for(2)
    batches = make_batches(seed=11, batches_per_gateway=10, rows_per_batch=(0, 50))
    first = replay(spec, archived(batches, seed=1)).results
    second = replay(spec, archived(batches, seed=2, duplicate_fraction=0.6)).results
    comparison = compare_results(first, second, rel_tol=1e-12)
    assert comparison.equal, comparison
    assert comparison.rows == first.height


def test_replay_equals_what_the_combiners_emitted_in_memory() -> None:
    # The in-memory pipeline closes windows as a live combiner does (watermark, idle time);
    # every window it emitted must come out of the replay identically.
    spec = spec_for(2)
    batches = make_batches(seed=5, batches_per_gateway=14, rows_per_batch=(1, 80), gap_every=5)
    emitted, _late, _ = run_in_memory(spec, batches, seed=5)
    live = emitted.with_columns(pl.lit(spec.name).alias("pipeline"))
    result = replay(spec, archived(batches, seed=9))
    comparison = compare_results(live, result.results)
    assert comparison.equal, f"{comparison}\n{comparison.examples}"
    assert comparison.rows == live.height > 0


def test_replay_skips_holes_unreadable_and_foreign_batches() -> None:
    spec = spec_for(1)
    batches = make_batches(seed=3, gateways=2, batches_per_gateway=8, rows_per_batch=(5, 20))
    holes = [b for b in batches if not (b.gateway_id == "gw0" and b.seq in (3, 4))]
    frame = archived(holes, seed=3, duplicate_fraction=0)
    junk = batch_row("ingest/s/gw9", b"not a batch", None, 1_700_000_000_500).with_columns(
        pl.lit("s").alias("stream")
    )
    other = frame.head(1).with_columns(pl.lit("elsewhere/s/gw0").alias("topic"))
    result = replay(spec, pl.concat([frame, junk, other], how="diagonal"))
    assert result.report.gaps == {"gw0": [(3, 4)]}
    assert result.report.unreadable == 1
    assert result.report.batches_archived == len(holes) + 1
    expected, _ = expected_results(all_rows(holes), spec)
    assert result.results.select("rows").sum().item() == expected.select("rows").sum().item()


def test_rejected_batches_advance_the_sequence() -> None:
    spec = parse_pipeline(
        {
            "name": "strict",
            "windows": [{"kind": "tumbling", "size_ms": 2_000}],
            "aggregates": ["count"],
            "limits": {"max_rows": 30},
        }
    )
    batches = make_batches(seed=4, gateways=1, batches_per_gateway=6, rows_per_batch=(10, 50))
    result = replay(spec, archived(batches, seed=4, duplicate_fraction=0))
    too_big = [b for b in batches if b.frame.height > 30]
    assert result.report.rejected == len(too_big) > 0
    assert result.report.batches_applied == len(batches)
    fine = [b for b in batches if b.frame.height <= 30]
    assert result.results["rows"].sum() + result.report.rows_late == sum(
        b.frame.height for b in fine
    )
