"""Through a real broker and worker: the issue's refused payloads reach the dead-letter topic
saying which syntax was assumed and why, with a specific code, and where the problem is.

Published the way a device engineer would: ``mosquitto_pub`` (with the MQTT 5 payload format
indicator for one of them) and a shoal session (with a content type).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import msgpack
import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.processors.spec import parse_pipeline
from shoal.schemas.topics import Topics
from tests.support.live import InProcessPipeline, collector

SPEC = parse_pipeline(
    {
        "name": "why",
        "windows": [{"kind": "tumbling", "size_ms": 1_000}],
        "aggregates": ["count"],
        "lateness_ms": 0,
        "idle_timeout_ms": 500,
        "checkpoint_interval_ms": 100,
    }
)
ENVELOPE = b'{"shoal":1,"enc":"json-rows","gateway_id":"gw","seq":5,"sent_at":0,"rows":'
ROW = b'{"sensor_id":"t1","ts":1700000000000,"value":21.5}'


@pytest.mark.skipif(shutil.which("mosquitto_pub") is None, reason="needs mosquitto_pub")
def test_refused_payloads_say_what_was_assumed_expected_and_found(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    topic = topics.ingest("s", "gw")
    latin1 = ENVELOPE + b'[{"sensor_id":"caf\xe9","ts":1,"value":1.0}]}'
    by_session = [
        (b"[" + ROW + b"]", None),  # a JSON array: once reported as MsgPack "extra data"
        (bytes([0x91]) * 3000, None),  # deep MsgPack: once an empty reason
        (latin1, None),  # invalid UTF-8: once "surrogates not allowed"
        (b"\x05" + ROW, "application/json"),  # a framing byte before JSON, typed as JSON
    ]
    by_cli = b"\x01" + ROW  # marked as UTF-8 text with the payload format indicator

    async def scenario() -> list[dict]:
        pipeline = InProcessPipeline(SPEC, broker.settings, topics, workers=1, state_dir=None)
        async with collector(broker.settings, topics, SPEC.name) as seen:
            await pipeline.start()
            async with AsyncSession(broker.settings, unique_client_id("dev")) as session:
                for payload, content_type in by_session:
                    await session.publish(topic, payload, content_type=content_type)
            cli = ["mosquitto_pub", "-V", "5", "-h", broker.settings.host]
            cli += ["-p", str(broker.settings.port), "-q", "1", "-t", topic, "-s"]
            cli += ["-D", "publish", "payload-format-indicator", "1"]
            await asyncio.to_thread(subprocess.run, cli, input=by_cli, check=True, timeout=10)
            for _ in range(200):
                if len(seen.deadletters) >= 5:
                    break
                await asyncio.sleep(0.05)
            await pipeline.stop()
            return [msgpack.unpackb(d, raw=False) for d in seen.deadletters]

    records = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert len(records) == 5
    errors = {record["payload"]: record["error"] for record in records}

    array = errors[by_session[0][0]]
    assert (array["code"], array["field"], array["format"]) == ("bad_type", "the batch", "JSON")
    assert "extra data" not in array["message"]
    assert "first byte '['" in array["assumed"]

    deep = errors[by_session[1][0]]
    assert (deep["reason"], deep["code"], deep["format"]) == (
        "bad_msgpack",
        "nesting_too_deep",
        "MsgPack",
    )
    assert "nested more than 1024 deep" in deep["message"]

    utf8 = errors[latin1]
    assert (utf8["code"], utf8["offset"], utf8["line"]) == (
        "invalid_utf8",
        latin1.index(b"\xe9"),
        1,
    )
    assert "surrogates" not in utf8["message"]
    assert utf8["found"] == "byte 0xe9 (invalid continuation byte)"

    typed = errors[by_session[3][0]]
    assert (typed["code"], typed["offset"], typed["format"]) == ("json_syntax", 0, "JSON")
    assert typed["assumed"] == "the content type 'application/json' says so"

    marked = errors[by_cli]
    assert (marked["code"], marked["format"]) == ("json_syntax", "JSON")
    assert "payload format indicator 1" in marked["assumed"]
    for record in records:
        assert record["error"]["message"]
        assert record["topic"] == topic
