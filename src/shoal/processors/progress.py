"""Per-gateway progress: contiguous sequence numbers, deduplication and event-time watermarks.

Batches of one gateway are applied strictly in ``seq`` order. A partial that arrives early waits
in a reorder buffer until every earlier seq is applied; one whose seq was already applied is a
duplicate and is dropped (counted). So a batch counts once, whatever the broker, the workers
or the gateway's re-sends do.

The gateway's *watermark* is the largest event time of its applied batches. Because batches
are applied in seq order, the watermark seen by batch ``s`` depends only on batches ``< s``:
lateness decisions are a pure function of each gateway's batch sequence, identical for any
number of workers, any delivery order, replays and restarts.

A gateway *holds* the pipeline watermark while it has something left for us: batches it
announced (``GatewayStatus``) that we have not applied, or recent progress (within
``idle_timeout_ms``). Idle gateways stop holding it; the pipeline watermark is the minimum over
holding gateways. Only *accepted* input is progress: a batch a worker refused (dead-lettered,
e.g. every timestamp too far in the future) advances the gateway's seq but neither its event
time nor its activity, and a gateway whose latest batch was refused holds nothing by what it
announces.

No gateway holds the others for longer than ``max_hold_ms`` (bounded hold). A gateway whose
watermark plus ``lateness_ms`` stays below the *reference* (the highest watermark of the
holding gateways, but never beyond the tracker's clock, so a clock running ahead cannot pull
the reference along) keeps windows open that every other gateway has finished. Once it has
done so for ``max_hold_ms`` while it had no backlog (no sealed batch of it waiting to be
applied: under overload a busy gateway trails because the pipeline is slow, and its data
is as valid as anyone's), it is *released*: it stops holding until its watermark catches up
with the pipeline watermark, and what it sends meanwhile for windows that closed is late.
A gateway without any accepted data yet holds at most ``max_hold_ms`` after it was first
seen or last made progress. So a gateway with a clock far behind, a silent one, or one whose
input is all refused delays the others' windows by at most ``max_hold_ms``.

The reorder buffer is bounded (``max_pending_weight``): when a batch goes missing (a worker
killed with batches in hand) or is merely slow (under overload a batch waits seconds at a busy
worker while the later ones, dealt to the others, overtake it) while the rest keep coming,
the newest early arrivals move to a ``Spill`` (files, read back when their turn comes) and,
once that is full too (or there is none), are let go (``deferred``, counted). Nothing is
lost: they are not confirmed, so their gateways still hold them and send them again. Letting
go is the last resort, not the first: every batch let go is published, computed and sent
again, and under overload those copies took the capacity the pipeline lacked (at 6 M meas/s
offered on 2 cores: 5,960 batches let go of 7,216, 1.9 M achieved, docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from shoal.processors.spec import default_max_hold_ms
from shoal.schemas.control import GatewayStatus

DISCOVERY_GRACE_MS: Final = 2_000
"""How long partials of a gateway never seen before wait for its status before the smallest
seq seen so far is taken as its first."""

T = TypeVar("T")


class Spilled:
    """Stands in ``GatewayProgress.pending`` for an early arrival kept by the ``Spill``."""

    __slots__ = ()


SPILLED: Final = Spilled()


class Spill(Protocol[T]):
    """Where early arrivals go when the reorder buffer's memory is full (``spill``)."""

    def room(self, weight: int) -> bool:
        """Whether an item weighing ``weight`` in memory may be spilled now."""
        ...

    def put(self, key: tuple[str, int], item: T) -> None:
        """Keep ``item`` until ``take`` or ``discard``."""
        ...

    def take(self, key: tuple[str, int]) -> T:
        """The item kept under ``key``, forgotten by the spill."""
        ...

    def discard(self, key: tuple[str, int]) -> None:
        """Forget the item kept under ``key``."""
        ...

    def clear(self) -> None:
        """Forget every item."""
        ...

    def __len__(self) -> int:
        """Items kept now."""
        ...


@dataclass
class GatewayProgress(Generic[T]):
    """What one combiner partition knows about one gateway.

    Attributes:
        gateway_id: the gateway.
        next_seq: the next seq to apply (None until the starting point is known).
        watermark_ms: largest event time applied so far (None before any data).
        last_progress_ms: clock time of the last applied batch (or of first sight).
        first_seen_ms: clock time the gateway was first seen.
        pending: early arrivals by seq, waiting for their turn (``SPILLED``: in the spill).
        announced_next_seq: ``next_seq`` of the gateway's latest status, if any.
        status_seen_ms: clock time that status arrived.
        applied: batches applied.
        duplicates: batches dropped as already applied.
        skipped: seqs the gateway no longer holds and we never saw (confirmed elsewhere).
        deferred: early arrivals let go because the reorder buffer was full (re-sent later).
        refused: batches applied as refused by a worker (no rows; not progress).
        last_refused: whether the latest applied batch was refused.
        hold_ms: for how long the gateway has kept windows open that every other holding
            gateway has finished, counting only time in which it had no backlog (a gateway
            with sealed batches still on their way is slow because the pipeline is, not
            broken); 0: it does not.
        released: released from holding after ``max_hold_ms`` (until it catches up).
        clock_offset_ms: processing clock at arrival minus the gateway's clock when it sealed
            the batch, for its latest accepted batch: transit time plus clock skew (large
            and positive: the gateway's clock is behind; negative: ahead).
    """

    gateway_id: str
    next_seq: int | None
    watermark_ms: int | None
    last_progress_ms: int
    first_seen_ms: int
    pending: dict[int, T | Spilled] = field(default_factory=dict)
    announced_next_seq: int | None = None
    status_seen_ms: int | None = None
    applied: int = 0
    duplicates: int = 0
    skipped: int = 0
    deferred: int = 0
    refused: int = 0
    last_refused: bool = False
    hold_ms: int = 0
    released: bool = False
    clock_offset_ms: int | None = None

    @property
    def applied_through(self) -> int:
        """Highest seq such that it and every earlier one is applied (-1: none yet)."""
        return -1 if self.next_seq is None else self.next_seq - 1

    def has_unapplied(self) -> bool:
        """Whether the gateway announced batches we have not applied yet."""
        if self.pending:
            return True
        if self.announced_next_seq is None:
            return False
        return self.next_seq is None or self.announced_next_seq > self.next_seq


class ProgressTracker(Generic[T]):
    """Sequence and watermark bookkeeping for all gateways of one combiner partition.

    ``T`` is whatever the caller applies (a ``Partial``); the tracker only orders them.
    """

    def __init__(
        self,
        idle_timeout_ms: int,
        max_hold_ms: int | None = None,
        *,
        lateness_ms: int = 0,
        max_pending_weight: int | None = None,
        weigh: Callable[[T], int] = lambda _: 1,
        spill: Spill[T] | None = None,
    ) -> None:
        self.idle_timeout_ms = idle_timeout_ms
        self.lateness_ms = lateness_ms
        self.max_pending_weight = max_pending_weight
        self._weigh = weigh
        self._weights: dict[tuple[str, int], int] = {}
        self.pending_weight = 0
        """Weight of the early arrivals held in memory (not those in the spill)."""
        self.spill = spill
        self.spilled_total = 0
        """Early arrivals moved to the spill so far."""
        # Even a gateway that keeps announcing batches we never receive lets go eventually.
        self.max_hold_ms = (
            max_hold_ms
            if max_hold_ms is not None
            else default_max_hold_ms(lateness_ms, idle_timeout_ms)
        )
        self.gateways: dict[str, GatewayProgress[T]] = {}
        self._bounded_at_ms: int | None = None
        self._cut: set[str] = set()
        """Gateways whose run ``_drain`` cut short: ``release`` goes on with them."""

    def reset(self) -> None:
        """Forget every gateway and everything pending (before restoring a checkpoint)."""
        if self.spill is not None:
            self.spill.clear()
        self.gateways = {}
        self._weights = {}
        self.pending_weight = 0
        self._cut = set()

    @property
    def spilled(self) -> int:
        """Early arrivals in the spill now."""
        return 0 if self.spill is None else len(self.spill)

    def _gateway(self, gateway_id: str, now_ms: int) -> GatewayProgress[T]:
        progress = self.gateways.get(gateway_id)
        if progress is None:
            progress = GatewayProgress(gateway_id, None, None, now_ms, now_ms)
            self.gateways[gateway_id] = progress
        return progress

    def offer(self, gateway_id: str, seq: int, item: T, now_ms: int) -> list[tuple[int, T]]:
        """Take one arrival; return the (seq, item) pairs now ready, in seq order.

        A duplicate returns nothing and is counted. Items of a gateway whose starting seq is
        unknown wait until ``note_status`` or ``resolve_starts`` sets it.
        """
        progress = self._gateway(gateway_id, now_ms)
        if (progress.next_seq is not None and seq < progress.next_seq) or seq in progress.pending:
            progress.duplicates += 1
            return []
        progress.pending[seq] = item
        weight = self._weigh(item)
        self._weights[(gateway_id, seq)] = weight
        self.pending_weight += weight
        ready = self._drain(progress)
        self._bound()
        return ready

    def _bound(self) -> None:
        """Keep the early arrivals held in memory within ``max_pending_weight``.

        The newest go to the spill; once it has no room (or there is none) they are let go.
        """
        if self.max_pending_weight is None:
            return
        while self.pending_weight > self.max_pending_weight:
            # The gateway holding the most in memory, its newest batch there: the furthest
            # from its turn.
            heaviest = max(
                (g for g in self.gateways.values() if self._in_memory(g)),
                key=lambda g: sum(self._weights.get((g.gateway_id, s), 0) for s in g.pending),
                default=None,
            )
            if heaviest is None:
                return
            seq = max(self._in_memory(heaviest))
            key = (heaviest.gateway_id, seq)
            if self.spill is not None and self.spill.room(self._weights[key]):
                item = heaviest.pending[seq]
                assert not isinstance(item, Spilled)
                self.spill.put(key, item)
                heaviest.pending[seq] = SPILLED
                self.spilled_total += 1
                self.pending_weight -= self._weights.pop(key)
                continue
            self._forget(heaviest, seq)
            heaviest.deferred += 1

    def _in_memory(self, progress: GatewayProgress[T]) -> list[int]:
        return [s for s, item in progress.pending.items() if not isinstance(item, Spilled)]

    def _forget(self, progress: GatewayProgress[T], seq: int) -> None:
        """Drop an early arrival, from memory or from the spill."""
        key = (progress.gateway_id, seq)
        self.pending_weight -= self._weights.pop(key, 0)
        if isinstance(progress.pending.pop(seq), Spilled) and self.spill is not None:
            self.spill.discard(key)

    def _take(self, progress: GatewayProgress[T], seq: int) -> T:
        """Remove an early arrival whose turn came; read it back if it was spilled."""
        key = (progress.gateway_id, seq)
        self.pending_weight -= self._weights.pop(key, 0)
        item = progress.pending.pop(seq)
        if not isinstance(item, Spilled):
            return item
        assert self.spill is not None
        return self.spill.take(key)

    def note_status(self, status: GatewayStatus, now_ms: int) -> list[tuple[int, T]]:
        """Take a gateway's announcement; may set its starting seq or skip confirmed gaps."""
        progress = self._gateway(status.gateway_id, now_ms)
        progress.announced_next_seq = status.next_seq
        progress.status_seen_ms = now_ms
        first = status.first_unconfirmed_seq
        if progress.next_seq is None:
            # Everything before `first` is confirmed, by this pipeline in an earlier life or by
            # another one: copies of those batches still in flight must not count again.
            progress.next_seq = first
            stale = [s for s in progress.pending if s < first]
            progress.duplicates += len(stale)
            for s in stale:
                self._forget(progress, s)
        elif first > progress.next_seq and progress.next_seq not in progress.pending:
            # The gateway dropped batches it had confirmed for another pipeline: we will
            # never see them. Move on, and say so in the counters.
            progress.skipped += first - progress.next_seq
            progress.next_seq = first
            # Early arrivals inside the skipped range can never be drained; left in the buffer
            # they would hold the pipeline watermark until max_hold_ms.
            for s in [s for s in progress.pending if s < first]:
                self._forget(progress, s)
        return self._drain(progress)

    def resolve_starts(self, now_ms: int) -> list[tuple[str, int, T]]:
        """Give gateways without status a start (their smallest pending seq) after a grace time."""
        ready: list[tuple[str, int, T]] = []
        for progress in self.gateways.values():
            if (
                progress.next_seq is None
                and progress.pending
                and now_ms - progress.first_seen_ms >= DISCOVERY_GRACE_MS
            ):
                progress.next_seq = min(progress.pending)
                ready.extend((progress.gateway_id, s, item) for s, item in self._drain(progress))
        return ready

    def release(self) -> list[tuple[str, int, T]]:
        """(gateway, seq, item) of early arrivals whose turn came but were not returned yet.

        What one call returns reads back from the spill at most about ``max_pending_weight``
        per gateway (``_drain``); a caller applies what it got, then calls again until
        nothing comes, so a long run that waited in the spill is never in memory whole.
        """
        ready: list[tuple[str, int, T]] = []
        if not self._cut:  # the usual case, after every step: nothing cut short
            return ready
        cut, self._cut = self._cut, set()
        for gateway_id in sorted(cut):
            progress = self.gateways.get(gateway_id)
            if progress is not None:
                ready.extend((gateway_id, s, item) for s, item in self._drain(progress))
        return ready

    def _drain(self, progress: GatewayProgress[T]) -> list[tuple[int, T]]:
        """The gateway's run of arrivals from its next seq on, taken out in seq order.

        It stops before a spilled arrival once those read back in this call weigh
        ``max_pending_weight`` (after one, whatever the bound: a run always moves): the rest
        stays where it is, next in line, for ``release``.
        """
        ready: list[tuple[int, T]] = []
        if progress.next_seq is None:
            return ready
        read_back = 0
        limit = self.max_pending_weight
        while progress.next_seq in progress.pending:
            seq = progress.next_seq
            spilled = isinstance(progress.pending[seq], Spilled)
            if spilled and limit is not None and read_back > 0 and read_back >= limit:
                self._cut.add(progress.gateway_id)
                break
            item = self._take(progress, seq)
            if spilled:
                read_back += self._weigh(item)
            ready.append((seq, item))
            progress.next_seq = seq + 1
        return ready

    def applied(
        self,
        gateway_id: str,
        max_ts: int | None,
        now_ms: int,
        *,
        clock_offset_ms: int | None = None,
    ) -> None:
        """Record that a ready item was applied (advances the gateway's watermark)."""
        progress = self.gateways[gateway_id]
        if clock_offset_ms is not None:
            progress.clock_offset_ms = clock_offset_ms
        progress.applied += 1
        progress.last_refused = False
        progress.last_progress_ms = now_ms
        if max_ts is not None and (progress.watermark_ms is None or max_ts > progress.watermark_ms):
            progress.watermark_ms = max_ts

    def refused(self, gateway_id: str) -> None:
        """Record that a ready item was a refused batch: its seq is done, nothing else moves."""
        progress = self.gateways[gateway_id]
        progress.applied += 1
        progress.refused += 1
        progress.last_refused = True

    def watermark(self, gateway_id: str) -> int | None:
        """The gateway's watermark (largest applied event time)."""
        progress = self.gateways.get(gateway_id)
        return None if progress is None else progress.watermark_ms

    def holds(self, progress: GatewayProgress[T], now_ms: int) -> bool:
        """Whether this gateway may hold the pipeline watermark back (before the drift bound).

        Recent accepted progress holds; announced but unapplied batches hold too, unless
        the gateway's latest batch was refused (what it announces is likely refused as well).
        A gateway none of whose input was accepted yet, and whose latest batch was refused,
        does not hold at all. Nothing holds ``max_hold_ms`` after the gateway's last
        accepted progress.
        """
        if progress.released or (progress.last_refused and progress.watermark_ms is None):
            return False  # released, or nothing accepted from it yet: not active
        quiet_for = now_ms - progress.last_progress_ms
        if quiet_for >= self.max_hold_ms:
            return False
        if progress.has_unapplied() and not progress.last_refused:
            return True
        return quiet_for < self.idle_timeout_ms

    def pipeline_watermark(self, now_ms: int) -> int | None:
        """Minimum watermark over holding gateways (None: nothing can close yet).

        A holding gateway without data yet blocks everything (for at most ``max_hold_ms``).
        When no gateway holds, the largest watermark counts: everyone is idle, so windows up
        to it can close. Applies the drift bound first (see the module docstring): this is
        also where gateways are released and readmitted.
        """
        holding = [g for g in self.gateways.values() if self.holds(g, now_ms)]
        self._bound_holds(holding, now_ms)
        holding = [g for g in holding if not g.released]
        watermark: int | None
        if holding:
            marks = [g.watermark_ms for g in holding]
            watermark = (
                None if any(m is None for m in marks) else min(m for m in marks if m is not None)
            )
        else:
            known = [g.watermark_ms for g in self.gateways.values() if g.watermark_ms is not None]
            watermark = max(known) if known else None
        self._readmit(watermark)
        return watermark

    def _bound_holds(self, holding: list[GatewayProgress[T]], now_ms: int) -> None:
        """Release gateways that have kept windows open for others for ``max_hold_ms``."""
        elapsed = 0 if self._bounded_at_ms is None else max(0, now_ms - self._bounded_at_ms)
        self._bounded_at_ms = now_ms
        marks = [g.watermark_ms for g in holding if g.watermark_ms is not None]
        if len(holding) < 2 or not marks:  # alone, a gateway holds nobody back
            for g in holding:
                g.hold_ms = 0
            return
        reference = min(max(marks), now_ms)
        for g in holding:
            if g.watermark_ms is not None and g.watermark_ms + self.lateness_ms >= reference:
                g.hold_ms = 0
            elif g.watermark_ms is not None and not g.has_unapplied():
                g.hold_ms += elapsed
                if g.hold_ms >= self.max_hold_ms:
                    g.released = True
            # Behind with a backlog, or without data yet: the hold clock stands still (the
            # ``max_hold_ms`` bound since the last accepted progress still applies).

    def _readmit(self, watermark: int | None) -> None:
        """Released gateways hold again once they have caught up with the pipeline."""
        for g in self.gateways.values():
            if (
                g.released
                and watermark is not None
                and g.watermark_ms is not None
                and g.watermark_ms >= watermark
            ):
                g.released = False
                g.hold_ms = 0

    def describe(self, now_ms: int) -> dict[str, dict[str, object]]:
        """Per gateway, what holds windows and why (heartbeats, ``shoal status``)."""
        return {
            g.gateway_id: {
                "watermark": g.watermark_ms,
                "holding": self.holds(g, now_ms),
                "holding_others_ms": self.holding_ms(g.gateway_id),
                "released": g.released,
                "refused_batches": g.refused,
                "clock_offset_ms": g.clock_offset_ms,
                "quiet_ms": now_ms - g.last_progress_ms,
            }
            for g in self.gateways.values()
        }

    def holding_ms(self, gateway_id: str) -> int:
        """How long the gateway has been keeping others' windows open (0: it is not)."""
        progress = self.gateways.get(gateway_id)
        if progress is None or progress.released:
            return 0
        return progress.hold_ms

    def gaps(self, limit: int) -> dict[str, tuple[int, ...]]:
        """Per gateway, the seqs we wait for while holding later ones (at most ``limit``).

        Right after a reordering these are merely slow; the combiner reports only those that
        stay missing for a whole confirmation interval (``missing`` in ``Confirm``).
        """
        gaps: dict[str, tuple[int, ...]] = {}
        for progress in self.gateways.values():
            if progress.next_seq is None or not progress.pending:
                continue
            missing: list[int] = []
            for seq in range(progress.next_seq, max(progress.pending)):
                if seq not in progress.pending:
                    missing.append(seq)
                    if len(missing) >= limit:
                        break
            if missing:
                gaps[progress.gateway_id] = tuple(missing)
        return gaps

    def confirmable(self) -> dict[str, int]:
        """Highest contiguous applied seq per gateway (for confirmations)."""
        return {
            g.gateway_id: g.applied_through
            for g in self.gateways.values()
            if g.next_seq is not None and g.applied_through >= 0
        }
