"""Session windows with a real broker: the sessions equal the polars oracle exactly.

Batches go out nearly in order with pauses, so sessions close while data still flows and
later pieces meet closed sessions; duplicated and reordered deliveries throughout. One case
crashes a combiner partition mid-stream (no last checkpoint: open sessions come back from the
previous one) and sends every batch again, as gateways re-send what was not confirmed;
another crashes a worker.

With ``allowed_lateness_ms`` (``test_latest_session_revisions_equal_the_oracle``) late pieces
within the allowance reach closed sessions: they extend them, move their start earlier (a
retraction in the old start's message) or join two of them; pieces beyond it are late.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import PipelineSpec
from shoal.schemas import Encoding
from shoal.schemas.results import RETRACTED
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import all_rows, make_batches, make_spec
from tests.support.in_memory import nearly_in_order
from tests.support.live import Collected, InProcessPipeline, run_with_crash
from tests.support.oracle import closed_by, expected_results, without_pending_sessions

pytestmark = pytest.mark.broker


def spec_for(partitions: int, allowed_lateness_ms: int = 0) -> PipelineSpec:
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
        allowed_lateness_ms=allowed_lateness_ms,
    )


def run_against_oracle(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path: Any,
    spec: PipelineSpec,
    workers: int,
    crash: str | None,
    *,
    seed: int,
    encoding: Encoding,
    late_by_ms: tuple[int, int],
) -> tuple[InProcessPipeline, Collected, int]:
    """Run the scenario; check the latest results against the oracle and the late reports
    (each batch's once per partition, exact in total). Returns the pipeline, what it
    published and the oracle's late count."""
    batches = make_batches(
        seed=seed,
        gateways=3,
        batches_per_gateway=20 if not spec.allowed_lateness_ms else 25,
        rows_per_batch=(0, 50),
        late_by_ms=late_by_ms,
        gap_every=4,
    )
    order = nearly_in_order(batches, np.random.default_rng(workers + seed), 6, 0.25)

    async def scenario() -> tuple[InProcessPipeline, Collected, int]:
        pipeline, seen, threshold = await run_with_crash(
            spec,
            batches,
            order,
            settings=broker.settings,
            topics=topics,
            workers=workers,
            state_dir=tmp_path,
            crash=crash,
            encoding=encoding,
        )
        rows = all_rows(batches)
        every, late_count = expected_results(rows, spec)
        expected = closed_by(every, spec, threshold)
        sessions = expected.filter(expected["window"].str.starts_with("session"))
        assert sessions.height > 20
        # a restarted combiner publishes sessions closed after its checkpoint again: identical
        emitted = without_pending_sessions(seen.latest_frame(), every, spec, threshold)
        assert_matches_oracle(emitted, expected, spec, scale_of(rows, spec))
        reports = {(m["partition"], m["gateway_id"], m["seq"]): m["rows"] for m in seen.late}
        assert late_count > 0
        assert sum(reports.values()) == late_count
        assert sum(c.core.counters.rows_late for c in pipeline.combiners) == late_count
        if crash is None:
            assert sum(m["rows"] for m in seen.late) == late_count
        return pipeline, seen, late_count

    return asyncio.run(scenario())


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
    run_against_oracle(
        broker,
        topics,
        tmp_path,
        spec_for(partitions),
        workers,
        crash,
        seed=workers * 5 + partitions,
        encoding=Encoding.BINARY_COLUMNAR,
        late_by_ms=(500, 8_000),
    )


@pytest.mark.parametrize(
    ("workers", "partitions", "crash"),
    [(1, 1, None), (3, 2, None), (3, 2, "combiner-1"), (3, 1, "worker-1")],
)
def test_latest_session_revisions_equal_the_oracle(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path,
    workers: int,
    partitions: int,
    crash: str | None,
) -> None:
    """Corrections: latest revisions = oracle over every piece not late by lateness + A."""
    _, seen, _ = run_against_oracle(
        broker,
        topics,
        tmp_path,
        spec_for(partitions, allowed_lateness_ms=5_000),
        workers,
        crash,
        seed=workers * 11 + partitions,
        encoding=Encoding.JSON_ROWS,
        late_by_ms=(500, 12_000),
    )
    # session corrections and at least one retraction were published
    assert any(m.get("correction") and m["window"].startswith("session") for m in seen.windows)
    assert any(r.get(RETRACTED) is not None for m in seen.windows for r in m["results"])
    # one revision, one content: copies of a message (a restart's re-publication) agree
    contents: dict[tuple[object, ...], str] = {}
    for m in seen.windows:
        identity = (m["window"], m["start"], m["partition"], m["revision"], m.get("part"))
        body = repr(sorted((str(r["key"]), r["rows"]) for r in m["results"]))
        assert contents.setdefault(identity, body) == body, identity
