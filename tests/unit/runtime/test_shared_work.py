"""A pool worker's pipelines share the decode and the partials of one batch's copies.

Logic only, on the in-memory broker: handlers sharing a ``SharedWork`` publish exactly the
partials each would publish alone (the oracle: a handler of its own, same clock), while the
batch is decoded once and its partials made once per fingerprint; a pipeline whose limits
are narrower than a remembered decode's decodes itself (and refuses what they refuse); a
remembered payload older than ``max_age_s`` is decoded afresh. On Mosquitto with real
processes: ``shoal bench pipelines`` (``tests/integration/test_bench_pool.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import polars as pl
import pytest

from shoal.broker.memory import MemoryBroker
from shoal.broker.session import Message
from shoal.clock import FakeClock
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.runtime._batches import BatchHandler, WorkerStats
from shoal.runtime._shared_work import SharedWork, covers
from shoal.schemas import DecodeLimits, Encoding, encode_batch
from shoal.schemas.topics import Topics

TOPICS = Topics(root="share")
TOPIC = TOPICS.ingest("s", "g1")


def spec(name: str, *, string_bytes: int = 256, where: str | None = None) -> PipelineSpec:
    raw: dict[str, Any] = {
        "name": name,
        "aggregates": ["count", "mean"],
        "partitions": 2,
        "limits": {"max_string_bytes": string_bytes},
        "windows": [{"size_ms": 1_000}],
    }
    if where is not None:
        raw["where"] = where
    return parse_pipeline(raw)


def message(seq: int, key: str = "a") -> Message:
    frame = pl.DataFrame(
        {"sensor_id": [key, "b", "c"], "ts": [100, 900, 2_100], "value": [1.0, 5.0, 2.0]}
    )
    payload = encode_batch(
        frame, gateway_id="g1", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS
    )
    return Message(TOPIC, payload, qos=1)


async def publishes(
    memory: MemoryBroker, handlers: list[BatchHandler], messages: list[Message]
) -> list[tuple[str, dict[str, Any] | None]]:
    """What the handlers publish, in order, for the messages (each to every handler in turn).

    Partials decoded (topic, body); dead letters as (topic, None).
    """
    out: list[tuple[str, dict[str, Any] | None]] = []
    async with (
        memory.session(memory.settings, "probe") as probe,
        memory.session(memory.settings, "worker") as session,
    ):
        await probe.subscribe([TOPICS.under_root("shoal/#")])
        for msg in messages:
            for handler in handlers:
                await session.wait_published(handler.handle(session, msg))
        await asyncio.sleep(0.05)
        async with asyncio.timeout(1):
            async for got in probe.messages():
                partial = "/partials/" in got.topic
                out.append((got.topic, msgpack.unpackb(got.payload) if partial else None))
                if len(out) == sum(2 for _ in handlers) * len(messages):
                    break
    return out


def handlers(
    specs: list[PipelineSpec], clock: FakeClock, shared: SharedWork | None
) -> list[BatchHandler]:
    stats = WorkerStats()
    return [BatchHandler(s, TOPICS, "w1", stats, clock, shared) for s in specs]


SPECS = [
    spec("p1"),
    spec("p2", string_bytes=300),  # another computation, the same partials
    spec("p3", where="value > 1"),  # another fingerprint
    spec("p4", string_bytes=257),
]


def test_shared_handlers_publish_what_each_publishes_alone() -> None:
    clock = FakeClock()
    shared = SharedWork(clock.monotonic)
    messages = [message(0), message(1)]
    alone = asyncio.run(publishes(MemoryBroker(), handlers(SPECS, clock, None), messages))
    together = asyncio.run(publishes(MemoryBroker(), handlers(SPECS, clock, shared), messages))
    assert together == alone
    assert [t for t, _ in together][:2] == [TOPICS.partials("p1", 0), TOPICS.partials("p1", 1)]
    assert {body["pipeline"] for _, body in together if body} == {"p1", "p2", "p3", "p4"}
    c = shared.counters
    # per batch: p1 decodes, p2 and p4 take it (wider string limits), p3 too;
    # p1 builds, p2 and p4 take its partials (same fingerprint), p3 builds its own
    assert (c.decodes, c.decodes_reused, c.builds, c.builds_reused) == (2, 6, 4, 4)


def test_narrower_limits_decode_for_themselves_and_refuse_what_they_refuse() -> None:
    clock = FakeClock()
    shared = SharedWork(clock.monotonic)
    long_key = "k" * 260  # within p2's 300 bytes, beyond p1's 256
    specs = [spec("p2", string_bytes=300), spec("p1")]
    out = asyncio.run(
        publishes(MemoryBroker(), handlers(specs, clock, shared), [message(0, long_key)])
    )
    by_pipeline = {(body or {}).get("pipeline", t) for t, body in out}
    assert "p2" in by_pipeline
    assert TOPICS.deadletter("p1") in {t for t, _ in out}
    rejected = [b for _, b in out if b and b["pipeline"] == "p1"]
    assert rejected
    assert all(b["status"] == "rejected" for b in rejected)
    assert shared.counters.decodes == 1  # the refusal is not remembered
    assert shared.counters.decodes_reused == 0


def test_a_payload_remembered_too_long_is_decoded_afresh() -> None:
    clock = FakeClock()
    shared = SharedWork(clock.monotonic, max_age_s=1.0)
    msg = message(0)
    handler = handlers([spec("p1")], clock, shared)[0]
    memory = MemoryBroker()

    async def twice() -> None:
        async with memory.session(memory.settings, "w") as session:
            await session.wait_published(handler.handle(session, msg))
            clock.advance(1_001)
            await session.wait_published(handler.handle(session, msg))

    asyncio.run(twice())
    assert (shared.counters.decodes, shared.counters.decodes_reused) == (2, 0)


@pytest.mark.parametrize("size", [1, 2])
def test_only_the_last_payloads_are_remembered(size: int) -> None:
    clock = FakeClock()
    shared = SharedWork(clock.monotonic, size=size)
    first, second = message(0), message(1)
    handler = handlers([spec("p1")], clock, shared)[0]
    memory = MemoryBroker()

    async def run() -> None:
        async with memory.session(memory.settings, "w") as session:
            for msg in (first, second, first):
                await session.wait_published(handler.handle(session, msg))

    asyncio.run(run())
    assert shared.counters.decodes_reused == (1 if size == 2 else 0)


def test_covers_only_wider_refusing_limits_and_equal_others() -> None:
    base = DecodeLimits()
    assert covers(base, base)
    assert covers(base, DecodeLimits(max_string_bytes=300, max_rows=2_000_000))
    assert not covers(base, DecodeLimits(max_string_bytes=200))
    assert not covers(base, DecodeLimits(max_future_ms=1_000))
    assert not covers(base, DecodeLimits(on_future="clamp"))
