"""Window result and alert messages for the bench's alert latency tests."""

from __future__ import annotations

from typing import Any

import orjson


def result_message(
    start: int, emitted_at: int, partition: int = 0, part: int | None = None
) -> bytes:
    """A window result message's header (CONTRACT §14), without results."""
    body: dict[str, Any] = {
        "shoal": 1,
        "pipeline": "p",
        "window": "tumbling-1s",
        "start": start,
        "end": start + 1000,
        "partition": partition,
        "partitions": 2,
        "emitted_at": emitted_at,
        "results": [],
    }
    if part is not None:
        body["part"], body["parts"] = part, 2
    return orjson.dumps(body)


def alert_message(start: int, at: int, state: str = "firing", partition: int = 0) -> bytes:
    """An alert transition (CONTRACT §24.1), the fields the bench reads."""
    return orjson.dumps(
        {
            "alert": "spike",
            "key": "s1",
            "state": state,
            "window": "tumbling-1s",
            "start": start,
            "end": start + 1000,
            "partition": partition,
            "at": at,
        }
    )
