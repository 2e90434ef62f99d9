"""``shoal sink postgres`` exactly once: killed -9 twice and its database restarted once
while a live pipeline publishes results with corrections and re-published windows, the
table equals the oracle (the latest revision of every window and key) with no duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from shoal._processes import ChildProcess
from shoal.broker.embedded import EmbeddedBroker
from shoal.loadtest.postgres import EmbeddedPostgres, read_table, sink_argv
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import all_rows, make_batches, two_window_spec
from tests.support.in_memory import nearly_in_order
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.oracle import expected_results
from tests.support.postgres import postgres

pytestmark = pytest.mark.broker
_ = postgres  # the fixture, imported for this module

AGGREGATES = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50", "p99"]
COMPARED = ["window", "start", "end", "key", "rows", "batches", *AGGREGATES]


def sink_process(
    broker: EmbeddedBroker, topics: Topics, dsn: str, table: str, log: Path
) -> ChildProcess:
    return ChildProcess(
        "sink", sink_argv(dsn, "fix", table, broker.settings, topics, "--heartbeat", "1"), log
    )


def wait_following(log: Path, times: int, timeout_s: float = 60) -> None:
    """Until the sink's log says it subscribed ``times`` times (its session exists)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count(": following ") >= times:
            return
        time.sleep(0.1)
    raise AssertionError(f"the sink did not subscribe: {log.read_text()[-2000:]}")


def test_killed_sink_and_restarted_database_lose_and_duplicate_nothing(
    broker: EmbeddedBroker, topics: Topics, postgres: EmbeddedPostgres, tmp_path: Path
) -> None:
    spec = two_window_spec(
        "fix",
        AGGREGATES,
        2,
        allowed_lateness_ms=5_000,
        idle_timeout_ms=4_000,
        checkpoint_interval_ms=100,
    )
    batches = make_batches(
        seed=5, gateways=3, batches_per_gateway=60, rows_per_batch=(0, 60), late_by_ms=(500, 12_000)
    )
    order = nearly_in_order(batches, np.random.default_rng(5), 6, 0.25)
    table = f"sink_{topics.root.replace('-', '_')}"
    sink = sink_process(broker, topics, postgres.dsn, table, tmp_path / "sink.log")
    faults: list[str] = []

    async def inject() -> None:
        await asyncio.sleep(1.5)
        sink.kill()
        faults.append("sink killed")
        await asyncio.sleep(0.7)
        sink.start()
        await asyncio.sleep(1.5)
        await asyncio.to_thread(postgres.restart, 0.5)
        faults.append("postgres restarted")
        await asyncio.sleep(1.5)
        sink.kill()
        faults.append("sink killed")
        await asyncio.sleep(0.7)
        sink.start()

    async def scenario() -> tuple[pl.DataFrame, int, int]:
        pipeline = InProcessPipeline(
            spec, broker.settings, topics, workers=2, state_dir=tmp_path / "state"
        )
        # The sink's persistent session must exist before results flow (as in production:
        # start sinks before pipelines); from then on the broker keeps what it misses.
        sink.start()
        await asyncio.to_thread(wait_following, tmp_path / "sink.log", 1)
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            faulting = asyncio.create_task(inject())
            publish = {"encoding": Encoding.JSON_ROWS, "pause_every": 6, "pause_s": 0.25}
            half = len(order) // 2
            await publish_batches(broker.settings, topics, batches, order[:half], **publish)
            # a combiner crash: windows published again with the same identity
            await pipeline.crash_combiner(1)
            await publish_batches(broker.settings, topics, batches, order[:half], **publish)
            await publish_batches(broker.settings, topics, batches, order[half:], **publish)
            try:
                await faulting
                await pipeline.resend_until_applied(
                    broker.settings, topics, batches, encoding=Encoding.JSON_ROWS
                )
                threshold = await pipeline.finish(batches)
            except BaseException:
                with contextlib.suppress(Exception):
                    await pipeline.stop()
                raise
        return seen.latest_frame(), threshold, len(seen.windows)

    try:
        latest, threshold, messages = asyncio.run(scenario())
        assert faults == ["sink killed", "postgres restarted", "sink killed"]
        # the sink catches up from its session: wait until the table stops changing
        deadline = time.monotonic() + 60
        stored = pl.DataFrame()
        while time.monotonic() < deadline:
            stored = read_table(postgres.dsn, table)
            if (
                stored.height >= latest.height
                and stored.select(pl.col("rows").sum()).item()
                == latest.select(pl.col("rows").sum()).item()
            ):
                break
            time.sleep(0.5)
    finally:
        sink.stop()
    log = (tmp_path / "sink.log").read_text()
    assert "retrying in" in log  # the sink saw the database go away, and retried
    assert sink.wait(1) == 0, log[-2000:]

    # no duplicates: one row per (pipeline, window, start, key)
    assert stored.height == stored.select("pipeline", "window", "start", "key").unique().height
    # the table equals the consumer's latest revisions, value for value
    got = stored.select(COMPARED).sort("window", "start", "key")
    want = latest.select(COMPARED).sort("window", "start", "key")
    assert got.equals(want), f"{got}\n{want}"
    # ... and the oracle over the whole data set
    rows = all_rows(batches)
    expected, _ = expected_results(rows, spec)
    expected = expected.filter(pl.col("end") <= threshold)
    assert_matches_oracle(stored.select(COMPARED), expected, spec, scale_of(rows, spec))
    assert (stored["revision"] > 1).any()  # corrections reached the table
    assert (stored["correction"] == (stored["revision"] > 1)).all()
    assert messages > stored.select("window", "start", "partition").unique().height
