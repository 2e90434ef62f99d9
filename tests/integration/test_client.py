"""The results client against a real broker and a live pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path

import orjson
import polars as pl
import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.probe import free_port
from shoal.broker.session import unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.client import (
    AsyncResultsClient,
    BrokerUnreachableError,
    NoSuchPipelineError,
    ResultsClient,
    ResultsTimeoutError,
)
from shoal.processors.results import Emission, WindowResult, window_json
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import make_batches
from tests.support.live import InProcessPipeline, collector, publish_batches

T0 = 1_700_000_000_000


def spec_for(partitions: int):
    # Lateness longer than the data: windows close only when the test flushes the combiners,
    # after the clients have long subscribed.
    return parse_pipeline(
        {
            "name": "live",
            "windows": [{"kind": "tumbling", "size_ms": 2_000}],
            "aggregates": ["count", "mean", "max", "p95"],
            "partitions": partitions,
            "lateness_ms": 3_600_000,
            "idle_timeout_ms": 1_000,
            "checkpoint_interval_ms": 200,
            "limits": {"max_future_ms": False},
        }
    )


async def flush(settings: BrokerSettings, topics: Topics, pipeline: str) -> None:
    async with AsyncSession(settings, unique_client_id("test-flush")) as session:
        await session.publish(topics.combiner_control(pipeline), orjson.dumps({"cmd": "flush"}))


def test_live_windows_latest_and_per_key(broker: EmbeddedBroker, topics: Topics) -> None:
    spec = spec_for(partitions=3)
    batches = make_batches(
        seed=2, gateways=2, batches_per_gateway=12, rows_per_batch=(20, 60), late_fraction=0
    )
    client = AsyncResultsClient(broker.settings, topic_root=topics.root, assemble_wait_s=5)

    async def scenario() -> None:
        pipeline = InProcessPipeline(spec, broker.settings, topics, workers=2, state_dir=None)
        for combiner in pipeline.combiners:
            combiner.config = dataclasses.replace(combiner.config, per_key_results=True)
        frames: list[pl.DataFrame] = []
        all_ts = pl.concat([b.frame["ts"] for b in batches])
        windows = (all_ts // 2_000).n_unique()
        got_all = asyncio.Event()

        async def consume() -> None:
            async for frame in client.windows(spec.name, idle_timeout_s=20):
                frames.append(frame)
                if len(frames) == windows:
                    got_all.set()

        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            consumer = asyncio.create_task(consume())
            latest = asyncio.create_task(client.latest(spec.name, n=3, timeout_s=20))
            await asyncio.sleep(1.0)  # both are subscribed before any window closes
            order = list(range(len(batches)))
            await publish_batches(
                broker.settings, topics, batches, order, encoding=Encoding.BINARY_COLUMNAR
            )
            last = {
                b.gateway_id: max(x.seq for x in batches if x.gateway_id == b.gateway_id)
                for b in batches
            }
            await pipeline.wait_applied(last)
            await flush(broker.settings, topics, spec.name)
            await asyncio.wait_for(got_all.wait(), 15)
            starts = {w["start"] for w in seen.windows}
            assert len(starts) == windows > 3
            consumer.cancel()
            three = await latest
            per_key = await client.latest_per_key(spec.name)
            await pipeline.stop()

        # one frame per window, with the keys of every partition
        expected = seen.results_frame()
        assert len(frames) == len(starts)
        got = pl.concat(frames)
        assert got.height == expected.height
        assert sorted(got["partition"].unique().to_list()) == [0, 1, 2]
        for frame in frames:
            assert frame.select("window", "start").unique().height == 1
            assert frame["key"].is_sorted()
        joined = got.join(expected, on=["window", "start", "key"], suffix="_live")
        assert joined.height == expected.height
        assert (joined["count"] == joined["count_live"]).all()
        assert (joined["mean"] == joined["mean_live"]).all()

        # the first three windows after subscribing, as one frame
        assert three.select("start").n_unique() == 3
        first_three = sorted(starts)[:3]
        assert sorted(three["start"].unique().to_list()) == first_three
        assert three.height == expected.filter(pl.col("start").is_in(first_three)).height

        # the retained latest value of every key
        keys = expected["key"].unique().sort().to_list()
        assert per_key["key"].to_list() == keys
        newest = expected.sort("start").group_by("key").last()
        check = per_key.join(newest, on="key", suffix="_live")
        assert (check["start"] == check["start_live"]).all()
        assert (check["count"] == check["count_live"]).all()

    asyncio.run(scenario())


def window_payload(topics: Topics, partition: int, partitions: int, keys: list[str]) -> bytes:
    frame = pl.DataFrame({"key": keys, "rows": [1] * len(keys), "batches": [1] * len(keys)})
    result = WindowResult("tumbling-2s", T0, T0 + 2_000, frame)
    return window_json(result, Emission("made", partition, partitions, T0 + 2_000, T0 + 2_100))


def single(start: int, key: str) -> bytes:
    frame = pl.DataFrame({"key": [key], "rows": [1], "batches": [1]})
    result = WindowResult("tumbling-2s", start, start + 2_000, frame)
    return window_json(result, Emission("made", 0, 1, start + 2_000, start + 2_100))


def test_republished_windows_are_delivered_once(broker: EmbeddedBroker, topics: Topics) -> None:
    client = AsyncResultsClient(broker.settings, topic_root=topics.root)
    results = topics.results("made")

    async def scenario() -> list[pl.DataFrame]:
        frames: list[pl.DataFrame] = []
        first = asyncio.Event()

        async def consume() -> None:
            async for frame in client.windows("made", count=3):
                frames.append(frame)
                first.set()

        task = asyncio.create_task(consume())
        async with AsyncSession(broker.settings, unique_client_id("fake-combiner")) as session:
            # Until the client is subscribed: copies of one window, delivered once.
            while not first.is_set():
                await session.publish(results, single(T0 - 2_000, "w"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(first.wait(), 0.2)
            # partition 1 of 2, then a combiner restart publishes it again, then partition 0
            for payload in (
                window_payload(topics, 1, 2, ["b", "d"]),
                window_payload(topics, 1, 2, ["b", "d"]),
                window_payload(topics, 0, 2, ["a", "c"]),
                window_payload(topics, 0, 2, ["a", "c"]),
                single(T0 + 2_000, "x"),
                single(T0 + 2_000, "x"),
            ):
                await session.publish(results, payload)
        await asyncio.wait_for(task, 10)
        return frames

    frames = asyncio.run(scenario())
    assert [f["key"].to_list() for f in frames] == [["w"], ["a", "b", "c", "d"], ["x"]]


def test_clear_errors(broker: EmbeddedBroker, topics: Topics, tmp_path: Path) -> None:
    nowhere = BrokerSettings(port=free_port())
    with (
        ResultsClient(nowhere) as client,
        pytest.raises(BrokerUnreachableError, match="cannot reach"),
    ):
        client.latest("default")

    with ResultsClient(broker.settings, topic_root=topics.root, discovery_timeout_s=0.5) as client:
        client.check()
        started = time.monotonic()
        with pytest.raises(NoSuchPipelineError, match="no pipeline named 'ghost'"):
            client.latest("ghost", timeout_s=10)
        with pytest.raises(NoSuchPipelineError):
            client.latest_per_key("ghost")
        assert time.monotonic() - started < 5

    # a pipeline that runs but has no data: a timeout that says what it waited for
    spec = spec_for(partitions=1)

    async def running() -> None:
        pipeline = InProcessPipeline(spec, broker.settings, topics, workers=1, state_dir=None)
        await pipeline.start()
        try:
            client = AsyncResultsClient(broker.settings, topic_root=topics.root)
            assert spec.name in await client.pipelines(wait_s=1.0)
            with pytest.raises(ResultsTimeoutError, match="only 0 of 2 windows") as caught:
                await client.latest(spec.name, n=2, timeout_s=1.5)
            assert isinstance(caught.value, TimeoutError)
            assert (await client.latest_per_key(spec.name, timeout_s=1)).height == 0
            with pytest.raises(ResultsTimeoutError, match="no window result"):
                async for _ in client.windows(spec.name, idle_timeout_s=1):
                    pass
        finally:
            await pipeline.stop()

    asyncio.run(running())
