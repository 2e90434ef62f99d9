"""The gateway's counters and the snapshot ``Gateway.stats()`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GatewayStats:
    """Counters of one gateway since it was created (``Gateway.stats()``).

    Attributes:
        rows_added: measurements accepted by ``add*``.
        rows_buffered: accepted but not yet sealed.
        rows_sealed: sealed into spooled batches.
        rows_published: in batches the broker accepted (first PUBACK of each batch).
        bytes_published: payload bytes of those batches (first PUBACK of each).
        batches_sealed: batches written to the spool (splits and empty fillers included).
        batches_published: distinct batches the broker accepted at least once.
        publishes: batch publishes handed to the broker, re-sends included.
        resends: publishes of batches that had been published before.
        batches_confirmed: batches confirmed and dropped from the spool.
        next_seq: the seq the next batch will carry.
        confirmed_seq: every batch up to this seq is confirmed (-1: none yet).
        spool_batches: batches in the spool (unconfirmed).
        spool_bytes: payload bytes in the spool.
        splits: times a batch was cut in half to fit the packet limit.
        rejected: rows refused by ``add*`` (invalid, spool full) or too large to send alone.
        connected: whether the broker connection is up.
    """

    rows_added: int
    rows_buffered: int
    rows_sealed: int
    rows_published: int
    bytes_published: int
    batches_sealed: int
    batches_published: int
    publishes: int
    resends: int
    batches_confirmed: int
    next_seq: int
    confirmed_seq: int
    spool_batches: int
    spool_bytes: int
    splits: int
    rejected: int
    connected: bool


@dataclass(slots=True)
class Counters:
    """The mutable counters behind ``GatewayStats`` (the gateway updates them under its lock)."""

    rows_added: int = 0
    rows_sealed: int = 0
    rows_published: int = 0
    bytes_published: int = 0
    batches_sealed: int = 0
    batches_published: int = 0
    publishes: int = 0
    resends: int = 0
    batches_confirmed: int = 0
    splits: int = 0
    rejected: int = 0
