"""The dead-letter record: whole when it fits, cut to fit the broker's limit when not."""

from __future__ import annotations

import hashlib

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from shoal.schemas.deadletter import deadletter_message

ERROR = {"error": "DecodeError", "reason": "bad_json", "field": None, "row": None}


def record(payload: bytes, max_bytes: int | None = None) -> tuple[bytes, dict]:
    packed = deadletter_message(
        pipeline="p",
        topic="ingest/s/gw",
        content_type=None,
        payload=payload,
        error=ERROR,
        worker="w",
        at_ms=1,
        max_bytes=max_bytes,
    )
    return packed, msgpack.unpackb(packed, raw=False)


def test_a_payload_that_fits_is_kept_whole() -> None:
    payload = b"\x00not a batch" * 10
    _, body = record(payload, max_bytes=10_000)
    assert body["payload"] == payload
    assert body["payload_truncated"] is False
    assert body["payload_bytes"] == len(payload)
    assert body["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    assert body["error"] == ERROR


@given(size=st.integers(0, 300_000), limit=st.integers(1_000, 200_000))
def test_a_record_never_exceeds_the_limit_and_describes_the_whole_payload(size, limit) -> None:
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    packed, body = record(payload, max_bytes=limit)
    assert len(packed) <= limit
    assert body["payload_bytes"] == size
    assert body["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    assert payload.startswith(body["payload"])
    assert body["payload_truncated"] == (len(body["payload"]) < size)
