"""A pinned worker with user functions on the in-memory broker: partials, dead letters, health.

Logic only (no Mosquitto): a batch a function fails on is dead-lettered with the raw payload
and the reason, its seq marked handled by rejected partials; the heartbeat's ``functions``
says what happened and fits its schema. Real processes and timing:
``tests/integration/test_functions_isolation.py``.
"""

from __future__ import annotations

import asyncio

import msgpack
import orjson
import polars as pl

from shoal.broker.memory import MemoryBroker
from shoal.broker.session import Message
from shoal.processors.partials import Partial
from shoal.processors.spec import parse_pipeline
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding, encode_batch
from shoal.schemas.topics import Topics
from tests.unit.schemas.test_output_contract import validator

TOPICS = Topics(root="fn")
CODE = """
def fix(value):
    if value.max() > 100:
        raise ValueError('out of range')
    return value * 2
"""


def batch(seq: int, value: float) -> bytes:
    frame = pl.DataFrame({"sensor_id": ["a", "b"], "ts": [100, 200], "value": [value, 1.0]})
    return encode_batch(frame, gateway_id="g1", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS)


def test_a_failing_function_dead_letters_its_batch_and_the_heartbeat_says_so() -> None:
    spec = parse_pipeline(
        {
            "name": "fn",
            "aggregates": ["count", "sum"],
            "windows": [{"size_ms": 1_000}],
            "derive": {"value": "fix(value)"},
            "functions": {"fix": {"code": CODE}},
            "degrade_after": 2,
            "limits": {"max_future_ms": False},
        }
    )
    memory = MemoryBroker()

    async def scenario() -> list[Message]:
        worker = Worker(
            WorkerConfig(spec, memory.settings, TOPICS, worker_id="w1", heartbeat_ms=20),
            session_factory=memory.session_factory,
        )
        got: list[Message] = []
        async with memory.session(memory.settings, "probe") as probe:
            await probe.subscribe(
                [
                    TOPICS.under_root("shoal/partials/#"),
                    TOPICS.deadletter("fn"),
                    TOPICS.metrics_all(),
                ]
            )

            async def pump() -> None:
                async for message in probe.messages():
                    got.append(message)

            tasks = [asyncio.create_task(worker.run()), asyncio.create_task(pump())]
            await asyncio.sleep(0.1)
            for seq, value in enumerate((5.0, 500.0, 600.0)):
                await probe.publish(TOPICS.ingest("s", "g1"), batch(seq, value))
            await asyncio.sleep(0.4)
            worker.stop()
            tasks[1].cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return got

    got = asyncio.run(scenario())
    partials = [Partial.decode(m.payload) for m in got if "/partials/" in m.topic]
    assert [(p.batch.seq, p.batch.status) for p in partials] == [
        (0, "ok"),
        (1, "rejected"),
        (2, "rejected"),
    ]
    assert partials[0].rows is not None
    assert sorted(partials[0].rows.fields["sum"].tolist()) == [2.0, 10.0]  # the UDF doubled
    dead = [msgpack.unpackb(m.payload) for m in got if m.topic == TOPICS.deadletter("fn")]
    assert [d["error"]["reason"] for d in dead] == ["function_error"] * 2
    assert all(d["error"]["error"] == "FunctionError" for d in dead)
    assert "ValueError: out of range (line 4 in fix)" in dead[0]["error"]["message"]
    assert dead[0]["payload"] == batch(1, 500.0)
    beats = [orjson.loads(m.payload) for m in got if "/metrics/worker/" in m.topic]
    validator("metrics-worker.schema.json").validate(beats[-1])
    health = beats[-1]["functions"]["fn"]
    assert health["batches_ok"] == 1
    assert health["failures"] == {"function_error": 2}
    assert health["degraded"] is True
