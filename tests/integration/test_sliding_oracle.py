"""Sliding windows with a real broker: latest revisions equal the polars oracle exactly.

A sliding window (3 s, step 500 ms) beside a tumbling one, over sparse keys so that many
(window, key) groups hold rows but no trigger, with allowed lateness: batches nearly in order
with duplicates and pauses, so windows close while data flows, late rows correct closed
windows (and trigger some for the first time) or fall beyond the allowance. 1, 3 and 5
workers, 1 and 2 partitions, a worker or a combiner crashing mid-stream.
"""

from __future__ import annotations

import asyncio

import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.schemas.topics import Topics
from tests.integration.test_corrections_oracle import AGGREGATES, run_and_compare
from tests.support.datasets import GeneratedBatch, all_rows, make_batches, make_spec
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

SLIDING = {"kind": "sliding", "size_ms": 3_000, "step_ms": 500}


def spec_for(partitions: int) -> PipelineSpec:
    return make_spec(
        "slide",
        [SLIDING, {"kind": "tumbling", "size_ms": 2_000}],
        AGGREGATES,
        partitions,
        allowed_lateness_ms=5_000,
        idle_timeout_ms=4_000,
        checkpoint_interval_ms=100,
    )


@pytest.mark.parametrize(
    ("workers", "partitions", "crash"),
    [(1, 1, None), (3, 2, "worker-1"), (5, 2, "combiner-1"), (5, 1, None)],
)
def test_sliding_latest_revisions_equal_the_oracle(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path,
    workers: int,
    partitions: int,
    crash: str | None,
) -> None:
    spec = spec_for(partitions)
    batches = make_batches(
        seed=workers * 5 + partitions,
        gateways=3,
        batches_per_gateway=24,
        rows_per_batch=(0, 60),
        keys=40,
        late_by_ms=(500, 12_000),
    )

    assert left_out(batches) > 0  # else this would test no more than hopping windows

    async def scenario() -> None:
        await run_and_compare(broker, topics, tmp_path, spec, batches, workers, crash)

    asyncio.run(scenario())


def left_out(batches: list[GeneratedBatch]) -> int:
    """(window, key) groups of the sliding window that hold rows but no trigger."""
    spec = spec_for(1)
    hopping = parse_pipeline(
        {
            "name": "slide",
            "windows": [{"kind": "hopping", "size_ms": 3_000, "slide_ms": 500}],
            "aggregates": ["count"],
            "limits": {"max_future_ms": False},
        }
    )
    rows = all_rows(batches)
    triggered = expected_results(rows, spec)[0].filter(pl.col("window") == "sliding-3s-500ms")
    return expected_results(rows, hopping)[0].height - triggered.height
