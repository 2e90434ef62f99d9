"""A heartbeat payload is the metrics' JSON, held in a buffer of its own size."""

from __future__ import annotations

import tracemalloc

import orjson

from shoal.runtime._heartbeat import heartbeat_payload

METRICS = {"component": "combiner", "gateways": {f"gw{i}": i * 1.5 for i in range(60)}}


def _held_bytes(make: object) -> int:
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        kept = [make() for _ in range(200)]  # type: ignore[operator]
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept) == 200
    return (after - before) // 200


def test_the_payload_is_the_metrics_json() -> None:
    assert heartbeat_payload(METRICS) == orjson.dumps(METRICS)
    assert orjson.loads(heartbeat_payload(METRICS)) == METRICS


def test_it_holds_about_its_length_where_orjson_holds_more() -> None:
    size = len(orjson.dumps(METRICS))
    assert _held_bytes(lambda: heartbeat_payload(METRICS)) < 1.2 * size + 64
    assert _held_bytes(lambda: orjson.dumps(METRICS)) > 1.5 * size  # why the copy exists
