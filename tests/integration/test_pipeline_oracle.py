"""Exactness with a real broker: workers in a shared subscription, combiner partitions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import make_batches
from tests.support.live import run_against_oracle

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
        run = await run_against_oracle(
            spec,
            batches,
            order,
            settings=broker.settings,
            topics=topics,
            workers=workers,
            state_dir=tmp_path,
            encoding=encoding,
        )
        assert run.late_count > 0  # the data set does exercise lateness
        for c in run.pipeline.combiners:
            assert c.core.counters.duplicate_batches > 0 or len(order) == len(batches)

    asyncio.run(scenario())
