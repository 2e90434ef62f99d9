"""Count windows with a real broker: 1, 3 and 5 workers, 1 and 2 partitions, crashes.

Batches are published nearly in order with pauses, so windows close while data still flows
and some rows arrive after the threshold passed them (late). Duplicated and reordered
deliveries throughout; a worker or a combiner partition crashes mid-stream (the combiner
without a last checkpoint) and the batches sent so far are sent again, as gateways re-send
what was not confirmed (``live.run_with_crash``). Every count window whose last row lies
before the final close threshold equals the polars oracle; late rows are counted exactly (at
least once after a combiner crash).
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
from tests.support.compare import assert_count_windows_match
from tests.support.datasets import all_rows, make_batches, make_spec
from tests.support.in_memory import nearly_in_order
from tests.support.live import run_with_crash
from tests.support.oracle import expected_count_results

pytestmark = pytest.mark.broker

AGGREGATES = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50", "p99"]


def spec_for(partitions: int) -> PipelineSpec:
    windows = [{"kind": "count", "n": 5}, {"kind": "count", "n": 12}]
    return make_spec("cnt", windows, AGGREGATES, partitions, checkpoint_interval_ms=100)


@pytest.mark.parametrize(
    ("workers", "partitions", "crash"),
    [(1, 1, None), (3, 2, None), (5, 1, "combiner-0"), (3, 2, "worker-1"), (5, 2, "combiner-1")],
)
def test_count_windows_equal_the_oracle(
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
        batches_per_gateway=24,
        rows_per_batch=(0, 50),
        late_by_ms=(500, 8_000),
    )
    rng = np.random.default_rng(workers * 10 + spec.partitions)
    order = nearly_in_order(batches, rng, 6, 0.25)

    async def scenario() -> None:
        pipeline, seen, threshold = await run_with_crash(
            spec,
            batches,
            order,
            settings=broker.settings,
            topics=topics,
            workers=workers,
            state_dir=tmp_path,
            crash=crash,
            encoding=Encoding.BINARY_COLUMNAR,
        )
        latest = seen.latest_frame()
        late = sum(item["rows"] for item in seen.late)
        expected, late_count, scale = expected_count_results(
            all_rows(batches), spec, threshold=threshold
        )
        # a partition that closed further than the common threshold emitted more
        emitted = latest.filter(pl.col("last_ts") < threshold)
        assert expected.height > 50
        assert_count_windows_match(emitted, expected, spec, scale)
        assert late_count > 0
        if crash is None or crash.startswith("worker"):
            assert late == late_count  # exact: every late row reported once (per window)
            assert sum(c.core.counters.rows_late for c in pipeline.combiners) == late_count
        else:
            assert late >= late_count  # batches applied after the last checkpoint come again
        for c in pipeline.combiners:
            assert c.core.counts is not None
            # at most n - 1 rows per key (12 in the data set) and window
            assert c.core.counts.tail_rows <= sum(w.count - 1 for w in spec.windows) * 12

    asyncio.run(scenario())
