"""Publishing spooled batches: first sends in seq order, PUBACK collection, re-sends.

The batches stay in the spool; the outbox knows which seqs are in flight (published, no
PUBACK yet), which were sent before, and where the first sends of this connection have
got to. ``ResendPolicy`` decides when to send again. Not thread-safe: the gateway calls
it under its lock. Speaks MQTT only through a ``GatewaySession``.

Two limits bound what one gateway puts into the pipeline at a time:

* ``max_inflight`` batches published without the broker's PUBACK (the MQTT hop), and
* ``max_unconfirmed_bytes`` of payload published without the *pipeline's* confirmation:
  the end-to-end window. A PUBACK only says the broker queued a batch; without this window
  a gateway with a backlog (a burst, a spool flushed after an outage) fills the broker's
  queue for the workers until Mosquitto drops messages, and the pipeline then waits for
  re-sends of what was dropped (issue 21, ``docs/guarantees.md`` "Overload"). With it, a
  burst stays in the gateway's spool (lag, which the scaler reads) and the broker holds at
  most one window per gateway. The first unconfirmed batch is always sendable, so a batch
  larger than the window still goes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from shoal.broker.session import GatewaySession, PublishHandle
from shoal.errors import BrokerError
from shoal.gateway._resend import ResendPolicy
from shoal.gateway.spool import Spool, SpoolEntry

log = logging.getLogger(__name__)

PAYLOAD_CACHE: Final = 8
"""Freshly sealed payloads kept in memory for their first send (older ones are re-read)."""


@dataclass(frozen=True, slots=True)
class Acked:
    """A batch the broker accepted (PUBACK with a success code)."""

    seq: int
    rows: int
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class _InFlight:
    handle: PublishHandle
    rows: int
    payload_bytes: int


class Outbox:
    """The publishing state of one gateway's connection.

    Args:
        topic: where batches are published.
        policy: when to re-send unconfirmed batches.
        spool: where the batches are.
        now_ms: monotonic milliseconds (the gateway's clock).
        max_inflight: batches published without PUBACK, at most.
        max_unconfirmed_bytes: payload bytes published without confirmation, at most (the
            first unconfirmed batch is always allowed).
    """

    def __init__(
        self,
        topic: str,
        policy: ResendPolicy,
        spool: Spool,
        now_ms: Callable[[], int],
        *,
        max_inflight: int,
        max_unconfirmed_bytes: int,
    ) -> None:
        self.topic = topic
        self.max_inflight = max_inflight
        self.max_unconfirmed_bytes = max_unconfirmed_bytes
        self.policy = policy
        self.publishes = 0
        self.resends = 0
        self._spool = spool
        self._now_ms = now_ms
        self._inflight: dict[int, _InFlight] = {}
        self._cursor = 0  # next seq to send for the first time on this connection
        self._sent: set[int] = set()  # seqs published at least once: the next send is a re-send
        self._cache: dict[int, bytes] = {}
        # Payload bytes of the seqs sent on this connection and not yet confirmed: the
        # end-to-end window's fill.
        self._window: dict[int, int] = {}
        self.window_bytes = 0
        self.window_waits = 0  # rounds in which a first send waited for the window

    @property
    def in_flight(self) -> int:
        """Batches published and not yet acknowledged."""
        return len(self._inflight)

    @property
    def window_full(self) -> bool:
        """Whether the end-to-end window holds as much as it may (first sends wait)."""
        return bool(self._window) and self.window_bytes >= self.max_unconfirmed_bytes

    def sealed(self, seq: int, payload: bytes) -> None:
        """A batch was sealed; keep its payload for the first send if there is room."""
        if len(self._cache) < PAYLOAD_CACHE:
            self._cache[seq] = payload

    def sent_before(self, seqs: Iterable[int]) -> None:
        """Seqs that may have been published by an earlier process (recovered from the spool)."""
        self._sent.update(seqs)

    def drop(self, seq: int) -> None:
        """The spooled batch ``seq`` changed or went away: forget its cached payload."""
        self._cache.pop(seq, None)

    def reconnected(self, first_unconfirmed: int) -> None:
        """Start over on a new connection.

        Everything unconfirmed goes out again (the broker may have lost it, design §3);
        handles of the old connection will never be acknowledged.
        """
        self._inflight.clear()
        self._window.clear()
        self.window_bytes = 0
        self._cursor = first_unconfirmed
        self.policy.reconnected(self._now_ms())

    def confirmed(self, through: int) -> None:
        """Every seq up to ``through`` is confirmed."""
        for seq in [s for s in self._cache if s <= through]:
            del self._cache[seq]
        self._sent.difference_update([s for s in self._sent if s <= through])
        for seq in [s for s in self._window if s <= through]:
            self.window_bytes -= self._window.pop(seq)
        self.policy.progressed(through, self._now_ms())

    def collect(self) -> list[Acked]:
        """Batches acknowledged since the last call.

        Failed publishes leave the in-flight set; a reconnect or the re-send policy sends
        them again.
        """
        acked = []
        for seq, flight in list(self._inflight.items()):
            if flight.handle.is_acknowledged():
                del self._inflight[seq]
                acked.append(Acked(seq, flight.rows, flight.payload_bytes))
            elif flight.handle.failed is not None:
                del self._inflight[seq]
                log.debug("publish of seq %d failed: %s", seq, flight.handle.failed)
        return acked

    def send(
        self,
        session: GatewaySession,
        *,
        first_unconfirmed: int,
        next_seq: int,
        fit: Callable[[SpoolEntry], SpoolEntry],
        missing: frozenset[int] = frozenset(),
    ) -> None:
        """Publish what is due, within ``max_inflight`` and the end-to-end window.

        First sends go in seq order, then the re-sends the policy asks for (``missing``:
        seqs a combiner reported missing). ``fit`` re-seals a batch larger than the current
        packet limit.
        """
        cursor = max(self._cursor, first_unconfirmed)
        while cursor < next_seq and len(self._inflight) < self.max_inflight:
            if self.window_full:
                self.window_waits += 1
                break
            if cursor not in self._inflight and not self._send(session, cursor, fit, resend=False):
                break
            cursor += 1
        self._cursor = cursor
        outstanding = (s for s in range(first_unconfirmed, cursor) if s not in self._inflight)
        for seq in self.policy.due(outstanding, self._now_ms(), missing):
            if len(self._inflight) >= self.max_inflight:
                break
            if not self._send(session, seq, fit, resend=True):
                break

    def _send(
        self,
        session: GatewaySession,
        seq: int,
        fit: Callable[[SpoolEntry], SpoolEntry],
        *,
        resend: bool,
    ) -> bool:
        """Hand one spooled batch to the session; False if it cannot be sent now."""
        entry = self._spool.get(seq)
        if entry is None:
            log.error("seq %d is not in the spool; skipping it", seq)
            return True
        entry = fit(entry)
        payload = self._cache.pop(seq, None)
        if payload is None:
            payload = self._spool.read(seq)
        try:
            handle = session.publish(self.topic, payload, qos=1, content_type=entry.content_type)
        except BrokerError as exc:  # disconnected meanwhile: the reconnect sends it again
            log.debug("publish of seq %d deferred: %s", seq, exc)
            return False
        self._inflight[seq] = _InFlight(handle, entry.rows, entry.payload_bytes)
        if seq not in self._window:
            self._window[seq] = entry.payload_bytes
            self.window_bytes += entry.payload_bytes
        self.publishes += 1
        if seq in self._sent:
            self.resends += 1
        self._sent.add(seq)
        self.policy.sent(seq, self._now_ms(), resend=resend)
        return True
