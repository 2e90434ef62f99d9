"""Bad input never kills a worker: it is dead-lettered with its reason, counted, and its seq
still counts as handled, so the gateway's later batches flow on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import polars as pl

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.schemas import Encoding, encode_batch
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support.live import InProcessPipeline, collector

SPEC = parse_pipeline(
    {
        "name": "dl",
        "windows": [{"kind": "tumbling", "size_ms": 1_000}],
        "aggregates": ["count", "mean", "p95"],
        "lateness_ms": 0,
        "idle_timeout_ms": 500,
        "checkpoint_interval_ms": 100,
        "output_encodings": ["json", "msgpack"],
        "limits": {"max_future_ms": False},
    }
)


def good(seq: int, ts0: int) -> bytes:
    frame = pl.DataFrame(
        {"sensor_id": ["a", "b", "a"], "ts": [ts0, ts0 + 1, ts0 + 2], "value": [1.0, 2.0, 3.0]}
    )
    return encode_batch(frame, gateway_id="gw", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS)


def test_bad_batches_are_dead_lettered_and_the_stream_goes_on(
    broker: EmbeddedBroker, topics: Topics, tmp_path
) -> None:
    not_finite = msgpack.unpackb(
        encode_batch(
            pl.DataFrame({"sensor_id": ["a"], "ts": [1_000_500], "value": [1.0]}),
            gateway_id="gw",
            seq=1,
            sent_at_ms=0,
            encoding=Encoding.MSGPACK_ROWS,
        ),
        raw=False,
    )
    not_finite["rows"][0]["value"] = float("nan")
    payloads = [
        good(0, 1_000_000),
        msgpack.packb(not_finite, use_bin_type=True),  # seq 1: readable envelope, bad row
        b"\x00garbage",  # no envelope at all: dead-lettered, no seq to mark
        good(2, 1_001_000),
        good(3, 1_002_500),
    ]

    async def scenario() -> None:
        pipeline = InProcessPipeline(SPEC, broker.settings, topics, workers=2, state_dir=tmp_path)
        async with collector(broker.settings, topics, SPEC.name) as seen:
            await pipeline.start()
            async with AsyncSession(broker.settings, unique_client_id("gw")) as session:
                status = GatewayStatus("gw", "s", 4, 0, 4, 0, None, 0, 0, 0)
                await session.publish(topics.gateway_status("gw"), status.to_json(), retain=True)
                for payload in payloads:
                    await session.publish(topics.ingest("s", "gw"), payload)
                await session.subscribe([topics.results_encoded(SPEC.name, "msgpack")])
                await pipeline.wait_applied({"gw": 3})
                await pipeline.wait_closed_through(1_002_000)
                async for message in session.messages():
                    columnar = msgpack.unpackb(message.payload, raw=False)
                    assert columnar["pipeline"] == SPEC.name
                    assert set(columnar["columns"]) >= {"key", "rows", "count", "mean", "p95"}
                    break
            await asyncio.sleep(0.3)
            await pipeline.stop()
            assert len(seen.deadletters) == 2
            records = [msgpack.unpackb(d, raw=False) for d in seen.deadletters]
            reasons = sorted(r["error"]["reason"] for r in records)
            assert reasons == ["bad_msgpack", "not_finite"]
            for record in records:
                assert record["topic"] == topics.ingest("s", "gw")
                assert record["payload"] in payloads  # the raw bytes, for inspection
            bad_row = next(r for r in records if r["error"]["reason"] == "not_finite")
            assert bad_row["error"]["field"] == "value"
            assert bad_row["error"]["row"] == 0
            assert sum(w.counters.deadletters for w in pipeline.workers) == 2
            assert all(c.core.counters.batches_rejected == 1 for c in pipeline.combiners)
            # Good rows of closed windows are all in results (the window of seq 3 is still
            # open: nothing has passed its end); seq 0..3 are all confirmed.
            counted = sum(r["rows"] for m in seen.windows for r in m["results"])
            assert counted == 6
            assert seen.confirms[("gw", 0)] == 3

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def per_key_run(
    broker: EmbeddedBroker,
    topics: Topics,
    tmp_path: Path,
    spec: PipelineSpec,
    batches: list[bytes],
    closed_through: int,
    pause_s: float = 0.0,
) -> int:
    """Run ``batches`` through a pipeline with per-key results; per-key results superseded.

    ``pause_s``: between two batches (so that each close is published before the next).
    """
    pipeline = InProcessPipeline(spec, broker.settings, topics, workers=1, state_dir=tmp_path)
    for combiner in pipeline.combiners:
        object.__setattr__(combiner.config, "per_key_results", True)
    await pipeline.start()
    async with AsyncSession(broker.settings, unique_client_id("gw")) as session:
        n = len(batches)
        status = GatewayStatus("gw", "s", n, 0, n, 0, None, 0, 0, 0)
        await session.publish(topics.gateway_status("gw"), status.to_json(), retain=True)
        for payload in batches:
            await session.publish(topics.ingest("s", "gw"), payload)
            await asyncio.sleep(pause_s)
        await pipeline.wait_closed_through(closed_through)
    await asyncio.sleep(0.5)
    superseded = sum(c.key_publications.superseded for c in pipeline.combiners)
    await pipeline.stop()
    return superseded


async def retained_keys(
    broker: EmbeddedBroker, topics: Topics, pipeline: str, keys: int
) -> dict[str, dict[str, Any]]:
    """What a dashboard connecting now gets at once: the latest result of each key."""
    async with AsyncSession(broker.settings, unique_client_id("dash")) as dash:
        await dash.subscribe([topics.result_keys(pipeline)])
        latest: dict[str, dict[str, Any]] = {}

        async def read() -> None:
            async for message in dash.messages():
                assert message.retain
                body = orjson.loads(message.payload)
                latest[body["key"]] = body
                if len(latest) == keys:
                    return

        await asyncio.wait_for(read(), 10)
    return latest


def test_per_key_results_are_retained(broker: EmbeddedBroker, topics: Topics, tmp_path) -> None:
    async def scenario() -> dict[str, dict[str, Any]]:
        batches = [good(0, 1_000_000), good(1, 1_003_000)]
        await per_key_run(broker, topics, tmp_path, SPEC, batches, 1_001_000)
        # A dashboard connecting afterwards gets the latest value of each key at once.
        return await retained_keys(broker, topics, SPEC.name, 2)

    latest = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert latest["a"]["count"] == 2
    assert latest["a"]["mean"] == 2.0
    assert latest["b"]["rows"] == 1
    assert np.isclose(latest["b"]["p95"], 2.0, rtol=0.01)


LATEST_SPEC: dict[str, Any] = {
    "name": "latest",
    "windows": [{"kind": "tumbling", "size_ms": 1_000}],
    "aggregates": ["count", "max"],
    "lateness_ms": 0,
    "idle_timeout_ms": 500,
    "checkpoint_interval_ms": 100,
    "limits": {"max_future_ms": False},
}
LATEST = parse_pipeline(LATEST_SPEC)


def test_only_the_newest_queued_result_of_a_key_is_published(
    broker: EmbeddedBroker, topics: Topics, tmp_path
) -> None:
    """Per-key results are a latest-value cache: a newer result of a key supersedes a queued one.

    Fifty one-second windows close in one step (one batch spans them, the next moves the
    watermark past them all: with a lateness longer than the span, the first closes none of
    them, whenever the second arrives). Each key's retained message must be its newest
    window's, a key that only an early window has must still get that window's value, and
    every older row of a key that a newer window has is counted as superseded instead of
    being published first.
    """
    t0, windows = 1_000_000, 50
    lateness_ms = (windows + 10) * 1_000
    spec = parse_pipeline({**LATEST_SPEC, "lateness_ms": lateness_ms})
    # keys a and b in every window (value = window index), c in window 3 only
    rows = [("a", t0 + w * 1_000 + 10, float(w)) for w in range(windows)]
    rows += [("b", t0 + w * 1_000 + 20, float(w)) for w in range(windows)]
    rows.append(("c", t0 + 3 * 1_000 + 30, 3.0))
    spanning = pl.DataFrame(rows, schema=["sensor_id", "ts", "value"], orient="row")
    later = pl.DataFrame(
        {"sensor_id": ["a"], "ts": [t0 + (windows + 5) * 1_000 + lateness_ms], "value": [0.0]}
    )
    batches = [
        encode_batch(frame, gateway_id="gw", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS)
        for seq, frame in enumerate([spanning, later])
    ]

    async def scenario() -> tuple[int, dict[str, dict[str, Any]]]:
        superseded = await per_key_run(
            broker, topics, tmp_path, spec, batches, t0 + windows * 1_000
        )
        return superseded, await retained_keys(broker, topics, spec.name, 3)

    superseded, latest = asyncio.run(asyncio.wait_for(scenario(), 60))
    last_start = t0 + (windows - 1) * 1_000
    assert (latest["a"]["start"], latest["a"]["max"]) == (last_start, windows - 1)
    assert (latest["b"]["start"], latest["b"]["max"]) == (last_start, windows - 1)
    assert (latest["c"]["start"], latest["c"]["max"]) == (t0 + 3_000, 3.0)
    # a and b: every window but the newest was superseded; c never was
    assert superseded == 2 * (windows - 1)


SESSIONS = parse_pipeline(
    {
        **LATEST_SPEC,
        "name": "visits",
        "windows": [{"kind": "session", "gap_ms": 1_000, "name": "visit"}],
    }
)


def test_a_close_of_many_sessions_retains_each_keys_latest_session(
    broker: EmbeddedBroker, topics: Topics, tmp_path
) -> None:
    """One close ends 31 session messages (30 keys, each its own start, and key a twice):
    their per-key results go out together after the window messages. Every key's retained
    message is its session's, with its own start and end, and key a keeps its later one."""
    t0, keys = 1_000_000, 30
    rows = [(f"k{i:02d}", t0 + i * 37, float(i)) for i in range(keys)]
    rows += [("a", t0 + 5, 100.0), ("a", t0 + 3_000, 200.0)]
    spanning = pl.DataFrame(rows, schema=["sensor_id", "ts", "value"], orient="row")
    later = pl.DataFrame({"sensor_id": ["z"], "ts": [t0 + 20_000], "value": [0.0]})
    batches = [
        encode_batch(frame, gateway_id="gw", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS)
        for seq, frame in enumerate([spanning, later])
    ]

    async def scenario() -> dict[str, dict[str, Any]]:
        await per_key_run(broker, topics, tmp_path, SESSIONS, batches, t0 + 10_000)
        return await retained_keys(broker, topics, SESSIONS.name, keys + 1)

    latest = asyncio.run(asyncio.wait_for(scenario(), 60))
    for i in range(keys):
        body = latest[f"k{i:02d}"]
        start = t0 + i * 37
        assert (body["start"], body["end"], body["count"], body["max"]) == (
            start,
            start + 1_000,
            1,
            float(i),
        )
        assert (body["pipeline"], body["window"], body["revision"]) == ("visits", "visit", 1)
    assert (latest["a"]["start"], latest["a"]["max"]) == (t0 + 3_000, 200.0)
    assert "z" not in latest  # its session is still open


def test_per_key_results_of_a_sliding_window_follow_key_results_every_ms(
    broker: EmbeddedBroker, topics: Topics, tmp_path
) -> None:
    """A 5-s sliding window stepping 1 s with key_results_every_ms = 5 s: windows of key a
    close one a batch, and a's per-key result is published only for the two that end on a
    multiple of 5 s (without the setting, for each of them)."""
    t0 = 1_000_000
    spec = parse_pipeline(
        {
            **LATEST_SPEC,
            "name": "steps",
            "windows": [{"kind": "sliding", "size_ms": 5_000, "step_ms": 1_000, "name": "s"}],
            "key_results_every_ms": 5_000,
        }
    )
    frames = [
        pl.DataFrame({"sensor_id": ["a"], "ts": [t0 + 100 + 1_000 * i], "value": [1.0]})
        for i in range(12)
    ]
    frames.append(pl.DataFrame({"sensor_id": ["z"], "ts": [t0 + 30_000], "value": [0.0]}))
    batches = [
        encode_batch(frame, gateway_id="gw", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS)
        for seq, frame in enumerate(frames)
    ]
    seen: list[tuple[int, int]] = []

    async def scenario() -> None:
        async with AsyncSession(broker.settings, unique_client_id("dash")) as dash:
            await dash.subscribe([topics.result_keys(spec.name)])

            async def read() -> None:
                async for message in dash.messages():
                    body = orjson.loads(message.payload)
                    seen.append((body["start"], body["end"]))

            reader = asyncio.create_task(read())
            await per_key_run(broker, topics, tmp_path, spec, batches, t0 + 20_000, 0.2)
            await asyncio.sleep(0.5)
            reader.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sorted(seen) == [(t0, t0 + 5_000), (t0 + 5_000, t0 + 10_000)]
