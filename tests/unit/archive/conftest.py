from __future__ import annotations

import orjson
import pytest

from shoal.schemas.results import WindowMessage, parse_window_message

T0 = 1_700_000_000_000


def window_message(
    *,
    pipeline: str = "p",
    window: str = "tumbling-10s",
    start: int = T0,
    size_ms: int = 10_000,
    partition: int = 0,
    partitions: int = 1,
    revision: int = 1,
    keys: tuple[str, ...] = ("a", "b"),
    watermark: int | None = None,
    scale: float = 1.0,
) -> WindowMessage:
    body = {
        "shoal": 1,
        "pipeline": pipeline,
        "window": window,
        "start": start,
        "end": start + size_ms,
        "revision": revision,
        "partition": partition,
        "partitions": partitions,
        "watermark": watermark if watermark is not None else start + size_ms,
        "emitted_at": start + size_ms + 5,
        "keys": len(keys),
        "rows": 3 * len(keys),
        "results": [
            {
                "key": key,
                "rows": 3,
                "batches": 1,
                "count": 3,
                "mean": scale * (i + 0.5),
                "stddev": None,
                "p95": 2.0 * i,
            }
            for i, key in enumerate(keys)
        ],
    }
    return parse_window_message(orjson.dumps(body), "application/json")


@pytest.fixture
def make_message():
    return window_message
