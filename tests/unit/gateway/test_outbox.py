"""The outbox's end-to-end window: first sends wait for confirmations, not only for PUBACKs.

The session here is an in-memory stand-in that acknowledges every publish at once, as a
broker with room in its queues does; the window is what keeps a backlog in the spool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from shoal.broker.session import GatewaySession
from shoal.clock import FakeClock
from shoal.gateway._outbox import Outbox
from shoal.gateway._resend import ResendPolicy
from shoal.gateway.spool import MemorySpool, SpoolEntry

TOPIC = "ingest/s/gw"


@dataclass
class _Handle:
    failed: str | None = None

    def is_acknowledged(self) -> bool:
        return True


@dataclass
class _AckingSession:
    """Accepts every publish at once (PUBACK), and remembers the order of the seqs."""

    sent: list[bytes] = field(default_factory=list)

    def publish(self, topic: str, payload: bytes, **_: Any) -> _Handle:
        assert topic == TOPIC
        self.sent.append(payload)
        return _Handle()


def _setup(sizes: list[int], window: int) -> tuple[Outbox, _AckingSession, FakeClock]:
    clock = FakeClock()
    spool = MemorySpool()
    spool.put(
        [
            (SpoolEntry(seq, "application/octet-stream", 10, size, 0), bytes([seq]) * size)
            for seq, size in enumerate(sizes)
        ]
    )
    outbox = Outbox(
        TOPIC,
        ResendPolicy(after_ms=60_000, window=4),
        spool,
        lambda: int(clock.monotonic() * 1000),
        max_inflight=1_000,
        max_unconfirmed_bytes=window,
    )
    return outbox, _AckingSession(), clock


def _send(outbox: Outbox, session: _AckingSession, confirmed: int, next_seq: int) -> list[int]:
    before = len(session.sent)
    outbox.send(
        cast("GatewaySession", session),
        first_unconfirmed=confirmed + 1,
        next_seq=next_seq,
        fit=lambda entry: entry,
    )
    outbox.collect()
    return [payload[0] for payload in session.sent[before:]]


def test_first_sends_stop_when_the_window_is_full_and_resume_on_confirmation() -> None:
    outbox, session, _ = _setup([100] * 10, window=300)
    assert _send(outbox, session, -1, 10) == [0, 1, 2]
    assert outbox.window_full
    assert _send(outbox, session, -1, 10) == []  # PUBACKs alone open nothing
    outbox.confirmed(1)
    assert _send(outbox, session, 1, 10) == [3, 4]
    outbox.confirmed(4)
    assert _send(outbox, session, 4, 10) == [5, 6, 7]
    assert outbox.window_waits >= 2


def test_a_batch_larger_than_the_window_still_goes_alone() -> None:
    outbox, session, _ = _setup([500, 500, 10], window=300)
    assert _send(outbox, session, -1, 3) == [0]
    outbox.confirmed(0)
    assert _send(outbox, session, 0, 3) == [1]
    outbox.confirmed(1)
    assert _send(outbox, session, 1, 3) == [2]


def test_a_reconnect_starts_a_new_window_from_the_first_unconfirmed_batch() -> None:
    outbox, session, _ = _setup([100] * 6, window=200)
    assert _send(outbox, session, -1, 6) == [0, 1]
    outbox.reconnected(0)  # everything unconfirmed goes again, within the window
    assert _send(outbox, session, -1, 6) == [0, 1]
    assert outbox.window_bytes == 200


def test_reported_missing_seqs_are_resent_within_the_window() -> None:
    outbox, session, clock = _setup([100] * 6, window=400)
    assert _send(outbox, session, -1, 6) == [0, 1, 2, 3]
    clock.advance(2_000)
    outbox.send(
        cast("GatewaySession", session),
        first_unconfirmed=0,
        next_seq=6,
        fit=lambda entry: entry,
        missing=frozenset({1}),
    )
    assert [p[0] for p in session.sent[4:]] == [1]
    assert outbox.resends == 1
