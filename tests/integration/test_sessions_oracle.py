"""Session windows with a real broker: the sessions equal the polars oracle exactly.

Batches go out nearly in order with pauses, so sessions close while data still flows and
later pieces meet closed sessions; duplicated and reordered deliveries throughout. One case
crashes a combiner partition mid-stream (no last checkpoint: open sessions come back from the
previous one) and sends every batch again, as gateways re-send what was not confirmed;
another crashes a worker.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import PipelineSpec
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import all_rows, make_batches, make_spec
from tests.support.in_memory import nearly_in_order
from tests.support.live import run_with_crash
from tests.support.oracle import closed_by, expected_results

pytestmark = pytest.mark.broker


def spec_for(partitions: int) -> PipelineSpec:
    return make_spec(
        "visits",
        [
            {"kind": "session", "gap_ms": 1_200, "max_duration_ms": 6_000},
            {"kind": "tumbling", "size_ms": 2_000},
        ],
        ["count", "sum", "mean", "min", "max", "first", "last", "p95"],
        partitions,
        idle_timeout_ms=4_000,
        checkpoint_interval_ms=100,
    )


@pytest.mark.parametrize(
    ("workers", "partitions", "crash"),
    [(1, 1, None), (3, 2, "combiner-1"), (5, 1, "worker-2"), (5, 2, None)],
)
def test_sessions_equal_the_oracle(
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
        batches_per_gateway=20,
        rows_per_batch=(0, 50),
        late_by_ms=(500, 8_000),
        gap_every=4,
    )
    order = nearly_in_order(batches, np.random.default_rng(workers), 6, 0.25)

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
        rows = all_rows(batches)
        expected, late_count = expected_results(rows, spec)
        expected = closed_by(expected, spec, threshold)
        sessions = expected.filter(expected["window"].str.starts_with("session"))
        assert sessions.height > 20
        # a restarted combiner publishes sessions closed after its checkpoint again: identical
        assert_matches_oracle(seen.latest_frame(), expected, spec, scale_of(rows, spec))
        # late rows: each batch's report once per (partition, gateway, seq), exact in total
        reports = {(m["partition"], m["gateway_id"], m["seq"]): m["rows"] for m in seen.late}
        assert late_count > 0
        assert sum(reports.values()) == late_count
        assert sum(c.core.counters.rows_late for c in pipeline.combiners) == late_count
        if crash is None:
            assert sum(m["rows"] for m in seen.late) == late_count

    asyncio.run(scenario())
