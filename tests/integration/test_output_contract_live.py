"""Every message a live pipeline publishes is described by CONTRACT.md and valid by its schema.

A real gateway, two workers and a combiner run on a real broker; a bad batch is dead-lettered,
a row comes late, a worker drains, the windows are flushed; a control plane runs beside it
and a pipeline is deployed and updated through it, hosted by a pool combiner. A subscriber
to the deployment's whole topic tree validates every message against the schema
``shoal.schemas.catalog`` names for its topic; a topic the catalog does not know fails the
test, so a new kind of message cannot appear without a schema and a contract section.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from jsonschema import Draft202012Validator

from shoal.broker import AsyncSession, Message, unique_client_id
from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.control.service import ControlPlane
from shoal.gateway import Gateway, GatewayConfig
from shoal.processors.spec import parse_pipeline
from shoal.runtime.hosting import CombinerHost, HostConfig
from shoal.schemas import Encoding, decode_batch
from shoal.schemas.catalog import MESSAGES, json_view, message_kind
from shoal.schemas.topics import Topics
from tests.support.live import InProcessPipeline

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
SPEC = parse_pipeline(
    {
        "name": "live",
        "windows": [{"kind": "tumbling", "size_ms": 1_000}],
        "aggregates": ["count", "mean", "stddev", "p95"],
        "lateness_ms": 200,
        "idle_timeout_ms": 1_000,
        "checkpoint_interval_ms": 100,
        "output_encodings": ["json", "msgpack"],
        # fires on the first window of every key: the alert message is published live too
        "alerts": [{"name": "seen", "condition": "count >= 1"}],
    }
)
GARBAGE = b"\x00garbage"
BAD_ROW = (
    b'{"shoal":1,"enc":"json-rows","gateway_id":"gw-bad","seq":0,"sent_at":0,'
    b'"rows":[{"sensor_id":"x","ts":1,"value":"warm"}]}'
)
RETAINED = {m.name for m in MESSAGES if m.retain}


def _validators() -> dict[str, Draft202012Validator]:
    out = {}
    for kind in MESSAGES:
        schema = json.loads((SCHEMAS / kind.schema).read_text("utf-8"))
        Draft202012Validator.check_schema(schema)
        out[kind.schema] = Draft202012Validator(schema)
    return out


def check(message: Message, topics: Topics, schemas: dict[str, Draft202012Validator]) -> str:
    """Validate one message against the contract; returns its kind."""
    kind = message_kind(topics, message.topic, message.payload)
    assert kind is not None, f"no contract for a message on {message.topic!r}"
    assert message.qos == kind.qos, (message.topic, message.qos)
    if kind.name == "batch":
        if message.payload in (GARBAGE, BAD_ROW):
            return kind.name  # the test's own bad input
        assert message.content_type == Encoding.JSON_ROWS.content_type
        decode_batch(message.payload, content_type=message.content_type)
        schemas[kind.schema].validate(orjson.loads(message.payload))
        return kind.name
    assert message.content_type == kind.content_type, (message.topic, message.content_type)
    if kind.name == "combiner-announcement" and not message.payload:
        return kind.name  # a cleared presence (§23: the member left)
    doc: Any = (
        orjson.loads(message.payload) if kind.syntax == "json" else json_view(message.payload)
    )
    schemas[kind.schema].validate(doc)
    if kind.name == "deadletter":
        assert tuple(message.user_properties) == (
            ("reason", doc["error"]["reason"]),
            ("code", doc["error"]["code"]),
        )
    return kind.name


async def _listen(settings: Any, topics: Topics, into: list[Message], ready: asyncio.Event) -> None:
    async with AsyncSession(settings, unique_client_id("contract")) as session:
        await session.subscribe([topics.under_root("#")], qos=1)
        ready.set()
        async for message in session.messages():
            into.append(message)


async def _retained(settings: Any, topics: Topics) -> list[Message]:
    """What a subscriber arriving now gets at once: the retained messages."""
    got: list[Message] = []
    async with AsyncSession(settings, unique_client_id("late-reader")) as session:
        await session.subscribe([topics.under_root("#")], qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                async for message in session.messages():
                    got.append(message)
    return got


def _gateway(broker: EmbeddedBroker, topics: Topics) -> Gateway:
    config = GatewayConfig(
        "gw-live",
        stream="s",
        broker=broker.settings,
        topics=topics,
        encoding=Encoding.JSON_ROWS,
        max_delay_ms=50,
        status_interval_ms=200,
        resend_after_ms=1_000,
    )
    return Gateway(config)


def test_every_published_message_has_a_schema_and_fits_it(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    schemas = _validators()
    seen: list[Message] = []

    async def scenario() -> None:
        pipeline = InProcessPipeline(SPEC, broker.settings, topics, workers=2, state_dir=tmp_path)
        for combiner in pipeline.combiners:
            combiner.config = replace(combiner.config, per_key_results=True)
        ready = asyncio.Event()
        listener = asyncio.create_task(_listen(broker.settings, topics, seen, ready))
        await asyncio.wait_for(ready.wait(), 10)
        await pipeline.start()
        plane, plane_stop = ControlPlane(broker.settings, topics, SystemClock()), asyncio.Event()
        plane_task = asyncio.create_task(plane.run(plane_stop))
        await asyncio.wait_for(plane.ready.wait(), 10)
        host = CombinerHost(HostConfig(broker.settings, topics, tmp_path / "pool", "live-pool"))
        host_task = asyncio.create_task(host.run())
        control = ControlClient(broker.settings, topics, timeout_s=10)
        for op, size in (("deploy", 1_000), ("update", 2_000)):
            text = f'name = "other"\n[[windows]]\nsize_ms = {size}\n'
            assert (await control.request(Request(op, op, spec_toml=text))).ok  # type: ignore[arg-type]
        base = (int(time.time() * 1000) // 1_000 - 10) * 1_000
        with _gateway(broker, topics) as gateway:
            for offsets in ([0, 250, 500], [2_500, 2_600], [100]):  # the last one is late
                ts = base + np.array(offsets, dtype=np.int64)
                gateway.add_many(np.array(["a", "b", "a"][: len(ts)]), ts, ts % 7 * 1.5)
                gateway.flush()
                await asyncio.sleep(0.3)  # one batch each, applied in this order
            async with AsyncSession(broker.settings, unique_client_id("bad")) as session:
                await session.publish(topics.ingest("s", "intruder"), GARBAGE)
                await session.publish(topics.ingest("s", "gw-bad"), BAD_ROW)
                assert await asyncio.to_thread(gateway.wait_confirmed, 20)
                pipeline.workers[0].drain()  # a drain marker on its control topic
                await asyncio.wait_for(pipeline.tasks[len(pipeline.combiners)], 10)
                await session.publish(
                    topics.combiner_control(SPEC.name), orjson.dumps({"cmd": "flush"})
                )
                await asyncio.sleep(1.2)  # results, per-key results, another heartbeat
        await pipeline.stop()
        host.stop()  # its partitions' last checkpoints; its presence cleared
        await asyncio.wait_for(host_task, 10)
        plane_stop.set()
        await asyncio.wait_for(plane_task, 10)
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        retained = await _retained(broker.settings, topics)
        kinds = {check(m, topics, schemas) for m in retained}
        assert all(m.retain for m in retained)
        # A pool combiner's presence is cleared when it leaves (seen live above).
        assert kinds == RETAINED - {"combiner-announcement"}

    asyncio.run(asyncio.wait_for(scenario(), 60))
    kinds = [check(message, topics, schemas) for message in seen]
    assert set(kinds) == {m.name for m in MESSAGES}, sorted(set(kinds))
    late = [orjson.loads(m.payload) for m in seen if message_kind(topics, m.topic).name == "late"]
    assert late[0]["late"][0]["reason"] == "behind_watermark"
