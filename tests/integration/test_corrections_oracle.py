"""Late corrections with a real broker: the latest revisions equal the oracle exactly.

Batches are published nearly in order with pauses, so windows close while data still flows
and late rows reach closed windows (corrections) or fall beyond the allowance (late).
Duplicated and reordered deliveries throughout; optionally a combiner partition crashes
mid-stream (no last checkpoint) and every batch is sent again, as gateways re-send what was
not confirmed; or a worker crashes mid-stream.
"""

from __future__ import annotations

import asyncio

import numpy as np
import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import PipelineSpec
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import GeneratedBatch, all_rows, make_batches, two_window_spec
from tests.support.in_memory import nearly_in_order
from tests.support.live import InProcessPipeline, run_with_crash
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

AGGREGATES = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50", "p99"]


def spec_for(partitions: int) -> PipelineSpec:
    return two_window_spec(
        "fix",
        AGGREGATES,
        partitions,
        allowed_lateness_ms=5_000,
        idle_timeout_ms=4_000,
        checkpoint_interval_ms=100,
    )


@pytest.mark.parametrize(
    ("workers", "partitions", "crash"),
    [(1, 1, None), (3, 2, None), (3, 2, "combiner-1"), (5, 1, "combiner-0"), (3, 2, "worker-1")],
)
def test_latest_revisions_equal_the_oracle(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path,
    workers: int,
    partitions: int,
    crash: str | None,
) -> None:
    spec = spec_for(partitions)
    batches = make_batches(
        seed=workers * 7 + partitions,
        gateways=3,
        batches_per_gateway=30,
        rows_per_batch=(0, 60),
        late_by_ms=(500, 12_000),
    )

    async def scenario() -> None:
        pipeline = await run_and_compare(broker, topics, tmp_path, spec, batches, workers, crash)
        for c in pipeline.combiners:
            assert c.core.kept_windows() <= c.core.state.open_windows()

    asyncio.run(scenario())


async def run_and_compare(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path,
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    workers: int,
    crash: str | None,
) -> InProcessPipeline:
    """``live.run_with_crash`` over batches nearly in order, then the latest revisions
    against the oracle and the late rows reported."""
    rng = np.random.default_rng(workers * 10 + spec.partitions)
    order = nearly_in_order(batches, rng, 6, 0.25)
    pipeline, seen, threshold = await run_with_crash(
        spec,
        batches,
        order,
        settings=broker.settings,
        topics=topics,
        workers=workers,
        state_dir=tmp_path,
        crash=crash,
        encoding=Encoding.JSON_ROWS,
    )
    late = sum(item["rows"] for item in seen.late)
    rows = all_rows(batches)
    expected, late_count = expected_results(rows, spec)
    expected = expected.filter(pl.col("end") <= threshold)
    assert_matches_oracle(seen.latest_frame(), expected, spec, scale_of(rows, spec))
    # the data exercises both sides of the allowance, and corrections were published
    assert late_count > 0
    assert seen.corrections() > 0
    if crash is None or crash.startswith("worker"):
        assert late == late_count  # exact: every late row reported once
        assert sum(c.core.counters.rows_late for c in pipeline.combiners) == late_count
    else:
        # after the crash the batches applied since the last checkpoint come again and
        # their late rows are reported again; at least every one is reported
        assert late >= late_count
    return pipeline
