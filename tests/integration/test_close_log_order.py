"""A combiner publishes a close's results only once the close is in its log, on disk.

The log is written off the event loop (``shoal.runtime._log_writer``, one thread per process)
and the outputs hold what a close decided until then (``shoal.broker.held.HeldSession``).
Real Mosquitto; the disk made slow (every round of the writer waits before its flushes) so
that a result published without waiting would overtake its log entry. A consumer reads the
log file when each window message arrives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import orjson
import polars as pl
import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.runtime._log_writer import LogWriter
from shoal.runtime.combiner import CLOSE_LOG_FILE, CombinerConfig, CombinerRuntime
from shoal.schemas import FRAME_SCHEMA
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support.live import until

pytestmark = pytest.mark.broker

SPEC = parse_pipeline(
    {
        "name": "ordered",
        "aggregates": ["count"],
        "lateness_ms": 0,
        "checkpoint_interval_ms": 60_000,
        "windows": [{"kind": "tumbling", "size_ms": 1000}],
    }
)
START = 1_700_000_000_000
SLOW_DISK_S = 0.5


def decisions(path: Path) -> int:
    """The closes and flushes the log file holds now."""
    if not path.exists():
        return 0
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(path.read_bytes())
    return sum(1 for entry in unpacker if entry.get("k") in ("close", "flush"))


def partial(seq: int, ts: list[int]) -> bytes:
    rows = len(ts)
    frame = pl.DataFrame(
        {
            "sensor_id": ["a"] * rows,
            "ts": ts,
            "value": [1.0] * rows,
            "name": ["t"] * rows,
            "type": ["t"] * rows,
            "unit": ["C"] * rows,
        },
        schema=FRAME_SCHEMA,
    )
    info = BatchInfo("gw", seq, "s", rows, min(ts), max(ts), START, START, "w")
    (built,) = PartialBuilder(SPEC, "w").build(frame, info, START)
    return built.encode()


def status(next_seq: int) -> bytes:
    return GatewayStatus("gw", "s", next_seq, 0, next_seq, next_seq, None, 0, 0, START).to_json()


def test_no_window_is_published_before_its_close_is_logged_on_disk(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    writer = LogWriter(delay_s=SLOW_DISK_S)
    config = CombinerConfig(
        SPEC, 0, broker.settings, topics, state_dir=tmp_path, per_key_results=False
    )
    runtime = CombinerRuntime(config, log_writer=writer)
    log_path = tmp_path / CLOSE_LOG_FILE
    # Per window message, on arrival: (start, decisions in the file, appends flushed so far).
    seen: list[tuple[int, int, int]] = []

    async def scenario() -> int:
        async with AsyncSession(broker.settings, unique_client_id("consumer")) as consumer:
            await consumer.subscribe([topics.results(SPEC.name)], qos=1)

            async def consume() -> None:
                async for message in consumer.messages():
                    body = orjson.loads(message.payload)
                    seen.append((body["start"], decisions(log_path), writer.synced))

            listening = asyncio.create_task(consume())
            task = asyncio.create_task(runtime.run())
            await until(lambda: runtime.serving, 20, "combiner subscribed")
            held = runtime._outputs
            assert held is not None
            async with AsyncSession(broker.settings, unique_client_id("gw")) as gateway:
                await gateway.publish(topics.gateway_status("gw"), status(3), retain=True)
                partials = topics.partials(SPEC.name, 0)
                await gateway.publish(partials, partial(0, [START + 100, START + 200]))
                await gateway.publish(partials, partial(1, [START + 1_100]))
                # Batch 2 moves the watermark past the first two windows: closes them.
                await gateway.publish(partials, partial(2, [START + 5_300]))
                await until(lambda: len(seen) >= 2, 20, "the closed windows")
                await gateway.publish(
                    topics.combiner_control(SPEC.name), orjson.dumps({"cmd": "flush"})
                )
                await until(lambda: len(seen) >= 3, 20, "the flushed window")
            runtime.stop()
            await asyncio.wait_for(task, 30)
            listening.cancel()
            return held.held_total

    try:
        held_total = asyncio.run(scenario())
    finally:
        writer.close()
    starts = [start for start, _, _ in seen]
    assert starts == [START, START + 1_000, START + 5_000]
    for start, logged, synced in seen:
        # The close (or flush) that published this window was in the file, and flushed.
        assert logged >= 1, (start, logged)
        assert synced >= 1, (start, synced)
    assert seen[-1][1] >= 2  # the flush after the close(s)
    assert held_total >= 3  # each window message waited for its (slow) write


def test_a_failed_log_write_publishes_nothing_it_decided(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    """A log that cannot be written (a folder where the file should be) ends the partition
    before any window it closed is published."""
    writer = LogWriter()
    config = CombinerConfig(
        SPEC, 0, broker.settings, topics, state_dir=tmp_path, per_key_results=False
    )
    runtime = CombinerRuntime(config, log_writer=writer)
    windows: list[bytes] = []

    async def scenario() -> BaseException | None:
        async with AsyncSession(broker.settings, unique_client_id("consumer")) as consumer:
            await consumer.subscribe([topics.results(SPEC.name)], qos=1)

            async def consume() -> None:
                async for message in consumer.messages():
                    windows.append(message.payload)

            listening = asyncio.create_task(consume())
            task = asyncio.create_task(runtime.run())
            await until(lambda: runtime.serving, 20, "combiner subscribed")
            log_path = tmp_path / CLOSE_LOG_FILE
            log_path.unlink()  # written at the restore; its next append fails
            log_path.mkdir()
            async with AsyncSession(broker.settings, unique_client_id("gw")) as gateway:
                await gateway.publish(topics.gateway_status("gw"), status(2), retain=True)
                partials = topics.partials(SPEC.name, 0)
                await gateway.publish(partials, partial(0, [START + 100]))
                await gateway.publish(partials, partial(1, [START + 5_300]))
            done, _ = await asyncio.wait({task}, timeout=20)
            await asyncio.sleep(0.5)  # anything published would have arrived by now
            listening.cancel()
            if not done:
                runtime.stop()
                await asyncio.wait_for(task, 30)
                return None
            return task.exception()

    try:
        failure = asyncio.run(scenario())
    finally:
        writer.close()
    assert isinstance(failure, OSError), failure
    assert windows == []
