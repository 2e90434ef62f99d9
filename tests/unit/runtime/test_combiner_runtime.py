"""The combiner, worker and scaler processes without a broker: their clocks and counters."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import polars as pl

from shoal.broker import Message
from shoal.broker.memory import MemoryBroker, MemorySession
from shoal.broker.settings import BrokerSettings
from shoal.clock import FakeClock
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.runtime.scaler import Scaler, ScalerConfig
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import FRAME_SCHEMA
from shoal.schemas.control import Confirm, GatewayStatus
from shoal.schemas.topics import Topics

SPEC = parse_pipeline({"name": "p", "windows": [{"kind": "tumbling", "size_ms": 1000}]})
OTHER = parse_pipeline({"name": "p", "windows": [{"kind": "tumbling", "size_ms": 5000}]})
START = 1_700_000_000_000


class _NoBackend:
    name = "none"

    def observe(self) -> int:
        return 1

    def scale_to(self, desired: int) -> None:
        pass

    def close(self) -> None:
        pass


def combiner(clock: FakeClock) -> CombinerRuntime:
    return CombinerRuntime(CombinerConfig(SPEC, 0, BrokerSettings()), clock)


def test_heartbeats_read_the_injected_clock() -> None:
    clock = FakeClock(START)
    runtimes = [combiner(clock), Worker(WorkerConfig(SPEC, BrokerSettings()), clock)]
    clock.advance(2_500)
    for runtime in runtimes:
        beat = runtime.metrics()
        assert beat["at"] == START + 2_500
        assert beat["uptime_s"] == 2.5


def test_the_scaler_records_its_decisions_at_the_injected_clock() -> None:
    clock = FakeClock(START)
    scaler = Scaler(ScalerConfig(SPEC, BrokerSettings(), http_port=None), _NoBackend(), clock=clock)
    clock.advance(7_000)
    assert scaler.decide(1).at_s == 7.0


def test_refused_partials_are_counted_in_the_heartbeat() -> None:
    clock = FakeClock(START)
    runtime = combiner(clock)
    topic = Topics().partials(SPEC.name, 0)
    assert runtime.metrics()["partials_refused"] == 0

    runtime._on_message(None, Message(topic, b"\x93not a partial"))
    assert runtime.metrics()["partials_refused"] == 1

    # A well-formed partial of another spec (another worker version) is refused too.
    info = BatchInfo("gw", 0, "s", 0, None, None, START, START, "w-old")
    builder = PartialBuilder(OTHER, "w-old")
    (foreign,) = builder.build(pl.DataFrame(schema=FRAME_SCHEMA), info, START)
    runtime._on_message(None, Message(topic, foreign.encode()))
    beat = runtime.metrics()
    assert beat["partials_refused"] == 2
    assert beat["foreign_partials"] == 1


def test_an_idle_partition_skips_its_periodic_checkpoints(tmp_path: Path) -> None:
    """A partition that took nothing since its last checkpoint writes none (1,000 idle pool
    partitions wrote 1,000 files a second); the next message makes the next one due, and the
    checkpoint at stop is always written."""
    spec = replace(SPEC, checkpoint_interval_ms=50)
    memory = MemoryBroker()
    clock = FakeClock(START)
    config = CombinerConfig(spec, 0, memory.settings, state_dir=tmp_path)
    runtime = CombinerRuntime(config, clock, session_factory=memory.session_factory)
    info = BatchInfo("gw", 0, "s", 1, None, None, START, START, "w")
    row = {"sensor_id": ["a"], "ts": [START], "value": [1.0], "name": ["t"], "type": ["t"]}
    frame = pl.DataFrame({**row, "unit": ["C"]}, schema=FRAME_SCHEMA)
    (partial,) = PartialBuilder(spec, "w").build(frame, info, START)

    async def scenario() -> tuple[int, int, int, int]:
        task = asyncio.create_task(runtime.run())
        await asyncio.sleep(0.6)  # a dozen intervals, idle: the first checkpoint only
        idle = (runtime.checkpoints, runtime.checkpoints_skipped)
        async with memory.session(memory.settings, "gw-worker") as worker:
            await worker.publish(Topics().partials(spec.name, 0), partial.encode())
        await asyncio.sleep(0.3)
        after = runtime.checkpoints
        runtime.stop()
        await task
        return (*idle, after, runtime.checkpoints)

    (idle_written, idle_skipped, after_message, at_stop) = asyncio.run(scenario())
    assert idle_written == 1
    assert idle_skipped >= 5
    assert after_message == 2  # the message made one due, then idle again
    assert at_stop == 3


def test_a_missing_first_batch_is_reported_before_anything_is_confirmable() -> None:
    """Seq 0 lost, 1 and 2 held: the confirmation names the gap with seq -1 (nothing applied
    yet). Without it the gateway learned of the gap only from its stall timer, whose backoff
    grows: a share member without read access kept a first batch away for 40 s in CI."""
    spec = replace(SPEC, checkpoint_interval_ms=50)
    memory = MemoryBroker()
    topics = Topics()
    config = CombinerConfig(spec, 0, memory.settings)
    runtime = CombinerRuntime(config, FakeClock(START), session_factory=memory.session_factory)
    row = {"sensor_id": ["a"], "ts": [START], "value": [1.0], "name": ["t"], "type": ["t"]}
    frame = pl.DataFrame({**row, "unit": ["C"]}, schema=FRAME_SCHEMA)

    def partial(seq: int) -> bytes:
        info = BatchInfo("gw", seq, "s", 1, START, START, START, START, "w")
        (built,) = PartialBuilder(spec, "w").build(frame, info, START)
        return built.encode()

    status = GatewayStatus("gw", "s", 3, 0, 3, 3, START, 0, 3, START)

    async def next_confirm(probe: MemorySession) -> Confirm:
        async with asyncio.timeout(5):
            async for message in probe.messages():
                return Confirm.from_json(message.payload)
        raise AssertionError("no confirmation")

    async def scenario() -> tuple[Confirm, Confirm]:
        task = asyncio.create_task(runtime.run())
        await asyncio.sleep(0.3)  # subscribed
        async with memory.session(memory.settings, "probe") as probe:
            await probe.subscribe([topics.confirm("gw", spec.name, 0)])
            await probe.publish(topics.gateway_status("gw"), status.to_json())
            for seq in (1, 2):
                await probe.publish(topics.partials(spec.name, 0), partial(seq))
            gap = await next_confirm(probe)
            await probe.publish(topics.partials(spec.name, 0), partial(0))
            filled = await next_confirm(probe)
        runtime.stop()
        await task
        return gap, filled

    gap, filled = asyncio.run(scenario())
    assert (gap.seq, gap.missing) == (-1, (0,))
    assert (filled.seq, filled.missing) == (2, ())
