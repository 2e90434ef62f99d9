"""User functions with a real broker: UDF and UDAF results equal plain polars, 1 and 3 workers.

The pipeline is the shipped examples together: ``udf.toml``'s calibration curve (a UDF in
``derive``) and plausibility check (a bool UDF as ``where``), and ``udaf-ewm.toml``'s
exponentially weighted mean (a UDAF), over a tumbling and a hopping window. The oracle
computes the same over the whole data set in plain polars (``tests/support/rules_oracle.py``
``USER_FUNCTIONS``, ``tests/support/oracle.py`` ``USER_AGGREGATES``): no user code is
called to compute what the pipeline must publish. Duplicated and reordered deliveries.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle
from tests.support.datasets import make_batches, two_window_spec
from tests.support.in_memory import shuffled_with_duplicates
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.rules_oracle import (
    example_functions,
    expected_with_rules,
    rows_of,
    with_attributes,
)

pytestmark = pytest.mark.broker


@pytest.mark.parametrize(("workers", "partitions"), [(1, 1), (3, 2)])
def test_udf_and_udaf_equal_plain_polars(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, workers: int, partitions: int
) -> None:
    spec = two_window_spec(
        "functions",
        ["count", "mean", "max", "ewm"],
        partitions,
        checkpoint_interval_ms=200,
        **example_functions(),
    )
    assert spec.calls_functions
    batches = with_attributes(
        make_batches(seed=21 + workers, gateways=3, batches_per_gateway=30, rows_per_batch=(0, 80)),
        seed=workers,
    )
    order = shuffled_with_duplicates(len(batches), np.random.default_rng(workers), 0.2)

    async def scenario() -> None:
        pipeline = InProcessPipeline(
            spec, broker.settings, topics, workers=workers, state_dir=tmp_path
        )
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            await publish_batches(
                broker.settings, topics, batches, order, encoding=Encoding.BINARY_COLUMNAR
            )
            threshold = await pipeline.finish(batches)
        want = expected_with_rules(rows_of(batches), spec)
        closed = pl.col("end") <= threshold
        assert want.filtered > 0  # the plausibility UDF removed rows
        expected = want.published.filter(closed)
        assert expected.height > 0
        assert_matches_oracle(seen.results_frame(), expected, spec, want.scale)
        assert sum(item["rows"] for item in seen.late) == want.late
        for c in pipeline.combiners:
            assert c.core.counters.rows_filtered == want.filtered
        assert not seen.deadletters
        for worker in pipeline.workers:
            health = worker.stats.functions_health()["functions"]
            assert health["batches_ok"] > 0
            assert health["failures"] == {}

    asyncio.run(scenario())
