"""Exactness with a real broker: workers in a shared subscription, combiner partitions."""

from __future__ import annotations

import asyncio

import numpy as np
import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import all_rows, make_batches
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.oracle import expected_results

AGGREGATES = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50", "p95", "p99"]


@pytest.mark.parametrize(
    ("workers", "partitions", "encoding"),
    [
        (1, 1, Encoding.BINARY_COLUMNAR),
        (3, 2, Encoding.JSON_ROWS),
        (5, 1, Encoding.MSGPACK_COLUMNAR),
        (5, 2, Encoding.MSGPACK_ROWS),
    ],
)
def test_results_equal_the_oracle(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path,
    workers: int,
    partitions: int,
    encoding: Encoding,
) -> None:
    spec = parse_pipeline(
        {
            "name": "oracle",
            "windows": [
                {"kind": "tumbling", "size_ms": 2_000},
                {"kind": "hopping", "size_ms": 4_000, "slide_ms": 2_000},
            ],
            "aggregates": AGGREGATES,
            "partitions": partitions,
            "lateness_ms": 1_000,
            "idle_timeout_ms": 1_500,
            "checkpoint_interval_ms": 200,
            "limits": {"max_future_ms": False},
        }
    )
    batches = make_batches(
        seed=workers * 7 + partitions,
        gateways=3,
        batches_per_gateway=25,
        rows_per_batch=(0, 120),
        gap_every=6,
    )
    rng = np.random.default_rng(workers)
    order = list(range(len(batches)))
    rng.shuffle(order)  # out of order across and within gateways
    order += [i for i in range(len(batches)) if rng.random() < 0.25]  # duplicated batches

    async def scenario() -> None:
        pipeline = InProcessPipeline(
            spec, broker.settings, topics, workers=workers, state_dir=tmp_path
        )
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            await publish_batches(broker.settings, topics, batches, order, encoding=encoding)
            last = {
                b.gateway_id: max(x.seq for x in batches if x.gateway_id == b.gateway_id)
                for b in batches
            }
            await pipeline.wait_applied(last)
            max_ts = max(int(b.frame["ts"].max()) for b in batches if b.frame.height)
            threshold = await pipeline.wait_closed_through(max_ts - spec.lateness_ms)
            await asyncio.sleep(0.5)  # the last results travel to the collector
            await pipeline.stop()
            rows = all_rows(batches)
            expected, late_count = expected_results(rows, spec)
            expected = expected.filter(pl.col("end") <= threshold)
            emitted = seen.results_frame()
            assert_matches_oracle(emitted, expected, spec, scale_of(rows, spec))
            assert sum(item["rows"] for item in seen.late) == late_count
            assert late_count > 0  # the data set does exercise lateness
            for c in pipeline.combiners:
                assert c.core.counters.duplicate_batches > 0 or len(order) == len(batches)

    asyncio.run(scenario())
