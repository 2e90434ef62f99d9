"""Hostile input through a running worker (``shoal worker`` as a process, real broker).

Malformed, truncated, oversized, wrongly typed, NaN/inf, future/ancient timestamps, too many
distinct keys, zip bombs, nesting bombs and hypothesis-drawn documents (``tests/support/
hostile.py``) are published, interleaved with good batches from several gateways (one with
20,000 distinct keys per batch). The worker must never crash or stall, must dead-letter
every bad payload exactly once with a reason (the reason a local decode gives, for the
structured ones), must mark the seqs of bad batches whose envelope names their gateway, and
the good measurements must all be counted exactly (compared with the oracle), with the
worker's memory bounded. The default run feeds 8,000 payloads; the ``slow`` one 100,000.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import orjson
import polars as pl
import psutil
import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.processors.spec import load_pipeline
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support import processes
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.hostile import Bad, Good, good_batches, hostile_stream
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

SPEC = """
name = "hostile"
inputs = ["ingest/+/+"]
lateness_ms = 0
idle_timeout_ms = 30000
partitions = 2
checkpoint_interval_ms = 200
aggregates = ["count", "sum", "mean", "min", "max", "p50"]

[[windows]]
kind = "tumbling"
size_ms = 1000

[limits]
max_payload_bytes = 4194304
max_rows = 50000
max_decompressed_bytes = 8388608
max_future_ms = 300000
max_past_ms = 604800000
"""

WINDOW_AHEAD = 3_000
"""Bad payloads published but not yet dead-lettered, at most (the worker's backlog)."""


@dataclass
class Seen:
    """What the test's subscriber saw (hashes only: 100,000 raw payloads are a lot)."""

    deadletters: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, str] = field(default_factory=dict)
    without_reason: int = 0
    arrivals: list[float] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)
    late_rows: int = 0
    confirms: dict[tuple[str, int], int] = field(default_factory=dict)
    combiners: dict[int, dict] = field(default_factory=dict)
    worker: dict = field(default_factory=dict)

    @property
    def deadletter_count(self) -> int:
        return sum(self.deadletters.values())


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


@contextlib.asynccontextmanager
async def watching(settings: BrokerSettings, topics: Topics, pipeline: str):
    seen = Seen()
    ready = asyncio.Event()

    def take(message: Message) -> None:
        topic = message.topic
        if topic == topics.deadletter(pipeline):
            record = msgpack.unpackb(message.payload, raw=False)
            digest = _digest(record["payload"])
            seen.deadletters[digest] += 1
            reason = (record.get("error") or {}).get("reason")
            if not reason:
                seen.without_reason += 1
            seen.reasons[digest] = str(reason)
            seen.arrivals.append(time.monotonic())
        elif topic == topics.results(pipeline):
            seen.windows.append(orjson.loads(message.payload))
        elif topic == topics.late(pipeline):
            seen.late_rows += orjson.loads(message.payload)["rows"]
        elif topic.startswith(topics.metrics_all()[:-1]):
            body = orjson.loads(message.payload)
            if body.get("component") == "combiner":
                seen.combiners[body["partition"]] = body
            elif body.get("component") == "worker":
                seen.worker = body
        elif message.payload:
            body = orjson.loads(message.payload)
            seen.confirms[(body["gateway_id"], body["partition"])] = body["seq"]

    async def listen() -> None:
        async with AsyncSession(
            settings, unique_client_id("hostile-watch"), clean_start=False, session_expiry_s=600
        ) as session:
            await session.subscribe(
                [
                    topics.deadletter(pipeline),
                    topics.results(pipeline),
                    topics.late(pipeline),
                    topics.confirm_all(),
                ],
                qos=1,
            )
            await session.subscribe([topics.metrics_all()], qos=0)
            ready.set()
            async for message in session.messages():
                take(message)

    task = asyncio.create_task(listen())
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _interleave(bad: list[Bad], good: list[Good]) -> list[Bad | Good]:
    step = max(1, len(bad) // (len(good) + 1))
    out: list[Bad | Good] = []
    pending = list(good)
    for i, item in enumerate(bad):
        if i % step == step - 1 and pending:
            out.append(pending.pop(0))
        out.append(item)
    return out + pending


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def run_hostile(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, *, total: int, good_per_gateway: int
) -> dict:
    spec_path = tmp_path / "hostile.toml"
    spec_path.write_text(SPEC)
    spec = load_pipeline(spec_path)
    now_ms = int(time.time() * 1000)
    base_ms = now_ms // 1000 * 1000 - 2 * 3_600_000
    started = time.monotonic()
    bad = hostile_stream(total, now_ms, spec.limits, seed=total)
    good = good_batches(
        base_ms=base_ms,
        gateways=3,
        batches=good_per_gateway,
        rows=400,
        wide_batches=3,
        wide_keys=20_000,
        seed=total,
    )
    generated_s = time.monotonic() - started
    stream = _interleave(bad, good)
    last_seq: dict[str, int] = {}
    for batch in good:
        last_seq[batch.gateway_id] = max(last_seq.get(batch.gateway_id, -1), batch.seq)
    settings = broker.settings
    components = [
        processes.combiner(p, spec_path, settings, topics, tmp_path / "state", tmp_path)
        for p in range(spec.partitions)
    ]
    worker = processes.worker(0, spec_path, settings, topics, tmp_path)
    rss: list[tuple[float, int]] = []

    async def sample(pid: int) -> None:
        process = psutil.Process(pid)
        while True:
            with contextlib.suppress(psutil.Error):
                rss.append((time.monotonic(), process.memory_info().rss))
            await asyncio.sleep(0.1)

    async def scenario() -> dict:
        async with watching(settings, topics, spec.name) as seen:
            await _until(
                lambda: (
                    seen.worker.get("state") == "running" and len(seen.combiners) == spec.partitions
                ),
                30,
                "the worker and the combiners",
            )
            assert worker.pid is not None
            pid = worker.pid
            sampler = asyncio.create_task(sample(pid))
            async with AsyncSession(settings, unique_client_id("hostile-pub")) as session:
                for gateway_id, last in last_seq.items():
                    status = GatewayStatus(gateway_id, "s", last + 1, 0, last + 1, 0, None, 0, 0, 0)
                    await session.publish(
                        topics.gateway_status(gateway_id), status.to_json(), retain=True
                    )
                publish_started = time.monotonic()
                sent_bad = 0
                futures: list[asyncio.Future[None]] = []
                for item in stream:
                    if isinstance(item, Bad):
                        sent_bad += 1
                        topic = topics.ingest("s", item.topic_gateway)
                    else:
                        topic = topics.ingest("s", item.gateway_id)
                    futures.append(
                        session.publish_started(topic, item.payload, content_type=item.content_type)
                    )
                    if len(futures) >= 200:
                        await session.wait_published(futures)
                        futures = []
                        # Stay a bounded backlog ahead of the worker (never the broker's limit).
                        await _until(
                            lambda sent=sent_bad: seen.deadletter_count >= sent - WINDOW_AHEAD,
                            60,
                            "the worker to keep up (a stall)",
                        )
                await session.wait_published(futures)
                await _until(lambda: seen.deadletter_count >= len(bad), 120, "every dead letter")
                dead_lettered_s = time.monotonic() - publish_started
                await _until(
                    lambda: all(
                        seen.confirms.get((g, p), -1) >= last
                        for g, last in last_seq.items()
                        for p in range(spec.partitions)
                    ),
                    60,
                    "confirmations of every good batch",
                )
                await session.publish(
                    topics.combiner_control(spec.name), orjson.dumps({"cmd": "flush"})
                )
                good_rows = sum(b.rows.height for b in good)
                await _until(
                    lambda: sum(w["rows"] for w in seen.windows) + seen.late_rows >= good_rows,
                    60,
                    "results of every good row",
                )
                await asyncio.sleep(1.5)  # a duplicate or a late heartbeat would show up now
            sampler.cancel()
            assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
            assert worker.pid == pid
            return {
                "seen": seen,
                "dead_lettered_s": dead_lettered_s,
            }

    try:
        for component in (*components, worker):
            component.start()
        outcome = asyncio.run(asyncio.wait_for(scenario(), 900))
    except BaseException:
        for component in (*components, worker):
            print(f"--- {component.name} ---\n{component.log_tail(40)}")
        raise
    finally:
        for component in (worker, *components):
            component.stop()

    seen: Seen = outcome["seen"]
    # 1. Every bad payload was dead-lettered exactly once, with a reason.
    expected = Counter(_digest(b.payload) for b in bad)
    assert seen.deadletters == expected
    assert seen.without_reason == 0
    for item in bad:
        if item.reason is not None:
            assert seen.reasons[_digest(item.payload)] == item.reason, item.source
    # 2. Bad batches that named their own gateway were marked as handled, by both partitions.
    marked = sum(1 for b in bad if b.marked)
    for beat in seen.combiners.values():
        assert beat["batches_rejected"] == marked, json.dumps(
            {k: v for k, v in beat.items() if "latency" not in k}
        )
    # 3. Every good measurement counted exactly once, with the right aggregates.
    rows = pl.concat([b.rows for b in good])
    want, late = expected_results(rows, spec)
    assert late == 0
    assert seen.late_rows == 0
    emitted = pl.DataFrame(
        [
            {"window": m["window"], "start": m["start"], "end": m["end"], **r}
            for m in seen.windows
            for r in m["results"]
        ],
        infer_schema_length=None,
    )
    assert_matches_oracle(emitted, want, spec, scale_of(rows, spec))
    assert sum(m["rows"] for m in seen.windows) == rows.height
    # 4. Never stalled, memory bounded.
    gaps = [b - a for a, b in zip(seen.arrivals, seen.arrivals[1:], strict=False)]
    first_fifth = [r for t, r in rss[: max(1, len(rss) // 5)]]
    baseline = statistics.median(first_fifth)
    peak = max(r for _, r in rss)
    end = statistics.median([r for _, r in rss[-max(1, len(rss) // 10) :]])
    figures = {
        "payloads": len(bad),
        "by_source": dict(Counter(b.source.split(":")[0] for b in bad)),
        "reasons": dict(Counter(seen.reasons[_digest(b.payload)] for b in bad).most_common()),
        "marked_seqs": marked,
        "dead_letters": seen.deadletter_count,
        "good_batches": len(good),
        "good_measurements": rows.height,
        "good_counted": sum(m["rows"] for m in seen.windows),
        "generation_s": round(generated_s, 1),
        "publish_to_last_dead_letter_s": round(outcome["dead_lettered_s"], 1),
        "payloads_per_s": round(len(bad) / outcome["dead_lettered_s"], 0),
        "max_gap_between_dead_letters_s": round(max(gaps, default=0.0), 2),
        "worker_rss_mb": {
            "baseline": round(baseline / 1e6, 1),
            "peak": round(peak / 1e6, 1),
            "end": round(end / 1e6, 1),
        },
        "worker_restarts": 0,
    }
    print("hostile input figures:", json.dumps(figures, indent=1))
    assert max(gaps, default=0.0) < 15.0
    assert peak - baseline < 400e6, figures
    assert end - baseline < 150e6, figures
    return figures


@pytest.mark.timeout(240)
def test_hostile_input_fast(broker: EmbeddedBroker, topics: Topics, tmp_path: Path) -> None:
    run_hostile(broker, topics, tmp_path, total=8_000, good_per_gateway=30)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hostile_input_100k(broker: EmbeddedBroker, topics: Topics, tmp_path: Path) -> None:
    figures = run_hostile(broker, topics, tmp_path, total=100_000, good_per_gateway=200)
    assert figures["payloads"] >= 100_000
    (Path(__file__).parents[2] / "var").mkdir(exist_ok=True)
    (Path(__file__).parents[2] / "var" / "hostile-100k.json").write_text(json.dumps(figures))


def test_a_refused_payload_near_the_packet_limit_is_dead_lettered(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    spec = load_pipeline_text(SPEC)
    worker = Worker(WorkerConfig(spec, broker.settings, topics))

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(worker.run())
        got = 0
        async with AsyncSession(broker.settings, unique_client_id("big")) as session:
            await session.subscribe([topics.deadletter(spec.name)])
            await asyncio.sleep(0.5)
            topic = topics.ingest("s", "gw")
            limit = 16 * 1024 * 1024  # the dev profile's max_packet_size
            await session.publish(topic, b"\x00" * (limit - len(topic) - 512))
            await session.publish(topic, b"small garbage")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    async for _ in session.messages():
                        got += 1
        worker.stop()
        await asyncio.wait_for(task, 10)
        return got, worker.counters.reconnects

    got, reconnects = asyncio.run(scenario())
    # Both dead-lettered (the big one with its payload cut to fit), no reconnect.
    assert (got, reconnects) == (2, 0)


def load_pipeline_text(text: str):
    import tomllib  # noqa: PLC0415

    from shoal.processors.spec import parse_pipeline  # noqa: PLC0415

    return parse_pipeline(tomllib.loads(text))
