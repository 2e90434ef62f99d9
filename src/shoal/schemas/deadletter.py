"""The dead-letter record (``shoal/deadletter/<pipeline>``, schemas/CONTRACT.md).

What a refused input becomes wherever it is refused (worker, combiner, adapter): where it came
from, why, and its raw bytes. A module of its own, so that a process that only refuses input
(``shoal adapt``) does not import the processors to do it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from shoal.schemas._model import SCHEMA_VERSION
from shoal.schemas._msgpack import pack

DEADLETTER_HEADROOM: Final = 4096
"""Bytes kept free under the broker's packet limit for the topic, properties and framing."""


def deadletter_message(
    *,
    pipeline: str,
    topic: str,
    content_type: str | None,
    payload: bytes,
    error: dict[str, Any],
    worker: str,
    at_ms: int,
    max_bytes: int | None = None,
) -> bytes:
    """The dead-letter record: where it came from, why it was refused, and the raw bytes.

    A record that would exceed ``max_bytes`` (what the broker accepts, less headroom) carries
    only the first bytes of the payload, with ``payload_truncated`` set; ``payload_bytes``
    and ``payload_sha256`` always describe the whole payload.
    """
    record: dict[str, Any] = {
        "shoal": SCHEMA_VERSION,
        "pipeline": pipeline,
        "topic": topic,
        "content_type": content_type,
        "error": error,
        "worker": worker,
        "at": at_ms,
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_truncated": False,
        "payload": payload,
    }
    packed = pack(record)
    if max_bytes is not None and len(packed) > max_bytes:
        keep = max(0, len(payload) - (len(packed) - max_bytes))
        record.update(payload=payload[:keep], payload_truncated=True)
        packed = pack(record)
    return packed
