"""The worker's ``publish_to_partial_ms``: gateway seal time → partials handed to the broker.

Driven on the in-memory broker with a fake clock: the figure is the worker's clock when the
partials went out minus the batch's ``sent_at``, per batch, and a refused batch (no send
time it can trust) adds nothing.
"""

from __future__ import annotations

import asyncio

from shoal.broker.memory import MemoryBroker
from shoal.clock import FakeClock
from shoal.loadtest.data import synthetic_block
from shoal.processors.spec import parse_pipeline
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding, encode_batch
from shoal.schemas.topics import Topics

TOPICS = Topics(root="lat")
SPEC = parse_pipeline(
    {"name": "lat", "aggregates": ["count", "p99"], "windows": [{"size_ms": 10_000}]}
)


def test_the_heartbeat_reports_seal_to_partials_per_batch() -> None:
    memory = MemoryBroker()
    clock = FakeClock()
    worker = Worker(
        WorkerConfig(SPEC, memory.settings, TOPICS, worker_id="w1"),
        clock,
        session_factory=memory.session_factory,
    )

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        async with memory.session(memory.settings, "gateway") as gateway:
            await asyncio.sleep(0.05)
            for seq, behind_ms in enumerate((40, 90)):
                payload = encode_batch(
                    synthetic_block(200, start_ms=clock.now_ms() - 5_000),
                    gateway_id="g1",
                    seq=seq,
                    sent_at_ms=clock.now_ms() - behind_ms,
                    encoding=Encoding.BINARY_COLUMNAR,
                )
                await gateway.publish(TOPICS.ingest("s", "g1"), payload)
            await gateway.publish(TOPICS.ingest("s", "g1"), b"not a batch")
            await asyncio.sleep(0.1)
        worker.stop()
        await task

    asyncio.run(scenario())
    beat = worker.metrics()
    assert worker.counters.batches == 2
    assert worker.counters.deadletters == 1
    figure = beat["publish_to_partial_ms"]
    assert isinstance(figure, dict)
    assert figure["n"] == 2  # the refused message has no send time to measure from
    assert 39 <= figure["p50"] <= 92
    assert 88 <= figure["max"] <= 90.5
