"""A live run archived, then replayed offline: the same windows, counts and values."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson
import polars as pl

from shoal.archive import (
    ArchiveConfig,
    Archiver,
    RolloverPolicy,
    compare_results,
    read_batches,
    read_results,
    replay,
)
from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.probe import free_port
from shoal.broker.session import unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.cli import main as shoal_main
from shoal.client import AsyncResultsClient
from shoal.processors.spec import load_pipeline
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import make_batches
from tests.support.live import InProcessPipeline, collector, publish_batches, until

SPEC_TOML = """
name = "recorded"
inputs = ["ingest/+/+"]
lateness_ms = 1000
idle_timeout_ms = 1500
partitions = 2
checkpoint_interval_ms = 200
aggregates = ["count", "sum", "mean", "min", "max", "stddev", "first", "last", "p50", "p95", "p99"]

[[windows]]
kind = "tumbling"
size_ms = 2000

[[windows]]
kind = "hopping"
size_ms = 4000
slide_ms = 2000

[limits]
max_future_ms = false
"""


def test_replay_of_an_archived_live_run_equals_the_live_results(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    spec_path = tmp_path / "recorded.toml"
    spec_path.write_text(SPEC_TOML)
    spec = load_pipeline(spec_path)
    archive = tmp_path / "archive"
    batches = make_batches(seed=21, gateways=3, batches_per_gateway=20, rows_per_batch=(0, 150))
    rng = np.random.default_rng(21)
    order = list(range(len(batches)))
    rng.shuffle(order)
    order += [i for i in range(len(batches)) if rng.random() < 0.2]  # re-sent batches
    config = ArchiveConfig(
        archive,
        broker.settings,
        topics,
        policy=RolloverPolicy(max_rows=400, max_age_s=0.5),
        tick_s=0.1,
    )

    async def scenario() -> tuple[list[dict], list[dict], object]:
        archiver = Archiver(config)
        archiving = asyncio.create_task(archiver.run())
        await asyncio.wait_for(archiver.connected.wait(), 10)
        pipeline = InProcessPipeline(spec, broker.settings, topics, workers=3, state_dir=None)
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            await publish_batches(
                broker.settings, topics, batches, order, encoding=Encoding.JSON_ROWS
            )
            last = {
                b.gateway_id: max(x.seq for x in batches if x.gateway_id == b.gateway_id)
                for b in batches
            }
            await pipeline.wait_applied(last)
            # End of the recording: every combiner closes its open windows, as at shutdown.
            async with AsyncSession(broker.settings, unique_client_id("test-flush")) as session:
                await session.publish(
                    topics.combiner_control(spec.name), orjson.dumps({"cmd": "flush"})
                )
            max_end = max(int(b.frame["ts"].max()) for b in batches if b.frame.height) + 4_000
            await pipeline.wait_closed_through(max_end - 4_000)
            await asyncio.sleep(0.5)  # the last results are published
            await pipeline.stop()
            # Both subscribers hold the same results topic at QoS 1: the archive has caught
            # up once it counts what the collector counts (a loaded machine can take longer
            # than any fixed sleep; 60 of 65 once in CI after 0.5 s).
            await asyncio.sleep(0.3)
            await until(
                lambda: archiver.received_results >= len(seen.windows),
                what="the archive receiving every result the collector received",
            )
        archiver.stop()
        report = await archiving
        return seen.windows, seen.late, report

    windows, late, report = asyncio.run(scenario())
    assert report.received_batches == len(order)
    assert report.received_results == len(windows) > 0

    # The archive holds exactly what a live consumer received.
    archived_batches = read_batches(archive)
    assert archived_batches.height == len(order)
    assert archived_batches.select("gateway_id", "seq").unique().height == len(batches)
    live = read_results(archive, spec.name)
    collected = sum(len(w["results"]) for w in windows)
    assert live.height == collected
    assert live.select("window", "start").unique().height > 10
    assert sorted(live["partition"].unique().to_list()) == [0, 1]

    # Replay: same keys, windows and counts; values within 1e-9 relative.
    result = replay(spec, archive)
    assert result.report.batches_applied == len(batches)
    assert result.report.duplicates == len(order) - len(batches)
    comparison = compare_results(live, result.results, rel_tol=1e-9, all_windows=True)
    assert comparison.equal, f"{comparison}\n{comparison.examples}"
    assert comparison.rows == live.height == result.results.height
    for column in ("rows", "batches", "count"):
        assert live[column].sum() == result.results[column].sum()
    assert result.report.rows_late == sum(item["rows"] for item in late) > 0

    # The latest windows straight from the archive (no broker needed when it has enough).
    client = AsyncResultsClient(BrokerSettings(port=free_port()))
    last = asyncio.run(client.latest(spec.name, n=3, window="tumbling-2s", archive=archive))
    ends = live.filter(pl.col("window") == "tumbling-2s")["end"].unique().sort().tail(3)
    assert sorted(last["end"].unique().to_list()) == ends.to_list()
    assert (
        last.height
        == live.filter(pl.col("end").is_in(ends) & (pl.col("window") == "tumbling-2s")).height
    )

    # The same through the command line.
    code = shoal_main(
        [
            "replay",
            "--archive",
            str(archive),
            "--pipeline",
            str(spec_path),
            "--compare",
            "--out",
            str(tmp_path / "replayed.parquet"),
        ]
    )
    assert code == 0
    assert pl.read_parquet(tmp_path / "replayed.parquet").height == live.height
