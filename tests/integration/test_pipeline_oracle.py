"""Exactness with a real broker: workers in a shared subscription, combiner partitions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import make_batches, two_window_spec
from tests.support.in_memory import shuffled_with_duplicates
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
    spec = two_window_spec("oracle", AGGREGATES, partitions, checkpoint_interval_ms=200)
    batches = make_batches(
        seed=workers * 7 + partitions,
        gateways=3,
        batches_per_gateway=25,
        rows_per_batch=(0, 120),
        gap_every=6,
    )
    rng = np.random.default_rng(workers)
    order = shuffled_with_duplicates(len(batches), rng, 0.25)

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
