"""Per-gateway progress: seq ordering, duplicates, starting points, watermarks and holding."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.progress import DISCOVERY_GRACE_MS, GatewayProgress, ProgressTracker
from shoal.processors.spec import default_max_hold_ms
from shoal.runtime._spill import DirectorySpill
from shoal.schemas.control import GatewayStatus

T0 = 1_700_000_000_000
IDLE = 1_000
MAX_HOLD = 5_000


def status(gateway_id: str, *, first: int, next_seq: int | None = None) -> GatewayStatus:
    next_seq = first if next_seq is None else next_seq
    return GatewayStatus(
        gateway_id=gateway_id,
        stream="s",
        next_seq=next_seq,
        first_unconfirmed_seq=first,
        unconfirmed_batches=next_seq - first,
        unconfirmed_rows=0,
        oldest_unconfirmed_ms=None,
        spool_bytes=0,
        rows_total=0,
        at_ms=T0,
    )


def tracker() -> ProgressTracker[str]:
    return ProgressTracker(IDLE, max_hold_ms=MAX_HOLD)


def started(first: int = 0, next_seq: int | None = None) -> ProgressTracker[str]:
    t = tracker()
    assert t.note_status(status("g", first=first, next_seq=next_seq), T0) == []
    return t


def apply_all(t: ProgressTracker[str], ready: list[tuple[int, str]], now: int) -> list[int]:
    """Apply released items the way the combiner does (max_ts = seq * 100 here)."""
    for seq, _ in ready:
        t.applied("g", seq * 100, now)
    return [seq for seq, _ in ready]


# -- ordering and duplicates -------------------------------------------------------------------


def test_in_order_release() -> None:
    t = started(0)
    assert t.offer("g", 0, "b0", T0) == [(0, "b0")]
    assert t.offer("g", 1, "b1", T0) == [(1, "b1")]
    assert t.gateways["g"].next_seq == 2


def test_early_seqs_wait_for_the_gap() -> None:
    t = started(0)
    assert t.offer("g", 2, "b2", T0) == []
    assert t.offer("g", 3, "b3", T0) == []
    assert set(t.gateways["g"].pending) == {2, 3}
    assert t.offer("g", 0, "b0", T0) == [(0, "b0")]
    assert t.offer("g", 1, "b1", T0) == [(1, "b1"), (2, "b2"), (3, "b3")]
    assert t.gateways["g"].pending == {}


def test_gaps_name_the_seqs_missing_below_held_ones() -> None:
    t = started(0)
    assert t.gaps(10) == {}
    t.offer("g", 0, "b0", T0)
    t.offer("g", 2, "b2", T0)
    t.offer("g", 5, "b5", T0)
    assert t.gaps(10) == {"g": (1, 3, 4)}
    assert t.gaps(2) == {"g": (1, 3)}
    t.offer("g", 1, "b1", T0)
    assert t.gaps(10) == {"g": (3, 4)}
    t.offer("g", 3, "b3", T0)
    t.offer("g", 4, "b4", T0)
    assert t.gaps(10) == {}


def test_a_gateway_without_a_start_has_no_gaps() -> None:
    t = tracker()
    t.offer("g", 7, "b7", T0)
    assert t.gaps(10) == {}


def test_duplicate_below_next_seq_is_dropped_and_counted() -> None:
    t = started(0)
    t.offer("g", 0, "b0", T0)
    t.offer("g", 1, "b1", T0)
    assert t.offer("g", 0, "again", T0) == []
    assert t.offer("g", 1, "again", T0) == []
    assert t.gateways["g"].duplicates == 2
    assert t.gateways["g"].next_seq == 2


def test_duplicate_of_a_pending_seq_keeps_the_first_copy() -> None:
    t = started(0)
    assert t.offer("g", 1, "first copy", T0) == []
    assert t.offer("g", 1, "second copy", T0) == []
    assert t.gateways["g"].duplicates == 1
    assert t.offer("g", 0, "b0", T0) == [(0, "b0"), (1, "first copy")]


def test_duplicates_of_a_gateway_without_a_start_are_counted() -> None:
    t = tracker()
    t.offer("g", 5, "x", T0)
    t.offer("g", 5, "y", T0)
    assert t.gateways["g"].duplicates == 1
    assert t.gateways["g"].next_seq is None


@settings(max_examples=100, deadline=None)
@given(
    order=st.lists(st.integers(0, 15), min_size=1, max_size=60),
    first=st.integers(0, 3),
)
def test_any_delivery_order_releases_each_seq_once_in_order(order: list[int], first: int) -> None:
    t = started(first)
    released: list[int] = []
    for seq in order:
        released += [s for s, _ in t.offer("g", seq, f"b{seq}", T0)]
    delivered = {s for s in order if s >= first}
    contiguous = 0
    while first + contiguous in delivered:
        contiguous += 1
    assert released == list(range(first, first + contiguous))
    progress = t.gateways["g"]
    assert set(progress.pending) == {s for s in delivered if s >= first + contiguous}
    assert progress.duplicates == len(order) - len(released) - len(progress.pending)


# -- starting points ---------------------------------------------------------------------------


def test_start_from_first_unconfirmed_seq() -> None:
    t = started(first=7, next_seq=9)
    assert t.gateways["g"].next_seq == 7
    assert t.offer("g", 5, "old", T0) == []  # confirmed long ago: a duplicate
    assert t.gateways["g"].duplicates == 1
    assert t.offer("g", 8, "b8", T0) == []
    assert t.offer("g", 7, "b7", T0) == [(7, "b7"), (8, "b8")]


def test_status_after_early_arrivals_releases_them() -> None:
    t = tracker()
    assert t.offer("g", 4, "b4", T0) == []
    assert t.offer("g", 3, "b3", T0) == []
    assert t.note_status(status("g", first=3, next_seq=5), T0 + 10) == [(3, "b3"), (4, "b4")]
    assert t.gateways["g"].next_seq == 5


def test_stale_copies_below_the_first_unconfirmed_seq_are_duplicates() -> None:
    # A copy of a batch confirmed before this tracker existed must not count again.
    t = tracker()
    assert t.offer("g", 2, "stale", T0) == []
    assert t.offer("g", 5, "b5", T0) == []
    assert t.note_status(status("g", first=5, next_seq=6), T0 + 10) == [(5, "b5")]
    assert t.gateways["g"].duplicates == 1
    assert t.gateways["g"].pending == {}


def test_later_status_with_an_older_first_seq_changes_nothing() -> None:
    t = started(0)
    apply_all(t, t.offer("g", 0, "b0", T0) + t.offer("g", 1, "b1", T0), T0)
    assert t.note_status(status("g", first=1, next_seq=2), T0) == []
    assert t.gateways["g"].next_seq == 2
    assert t.gateways["g"].skipped == 0


def test_skip_ahead_when_the_gateway_dropped_batches_we_never_saw() -> None:
    t = started(0, next_seq=2)
    apply_all(t, t.offer("g", 0, "b0", T0) + t.offer("g", 1, "b1", T0), T0)
    assert t.offer("g", 5, "b5", T0) == []
    assert t.offer("g", 6, "b6", T0) == []
    # 2, 3 and 4 were confirmed (for other pipelines) and dropped: we will never see them
    ready = t.note_status(status("g", first=5, next_seq=7), T0)
    assert ready == [(5, "b5"), (6, "b6")]
    progress = t.gateways["g"]
    assert progress.skipped == 3
    assert progress.next_seq == 7
    assert t.offer("g", 3, "late copy", T0) == []
    assert progress.duplicates == 1


def test_skip_ahead_leaves_no_stale_pending_batch() -> None:
    """A batch we saw but could not apply before the skip must not hold the gateway forever."""
    t = started(0, next_seq=2)
    apply_all(t, t.offer("g", 0, "b0", T0) + t.offer("g", 1, "b1", T0), T0)
    assert t.offer("g", 3, "b3", T0) == []
    t.note_status(status("g", first=5, next_seq=5), T0)
    progress = t.gateways["g"]
    assert progress.next_seq == 5
    assert progress.skipped == 3
    assert all(seq >= progress.next_seq for seq in progress.pending)
    assert not progress.has_unapplied()
    assert not t.holds(progress, T0 + IDLE)
    assert t.offer("g", 3, "b3 again", T0) == []
    assert t.offer("g", 5, "b5", T0) == [(5, "b5")]


def test_resolve_starts_after_the_grace_time() -> None:
    t = tracker()
    t.offer("g", 4, "b4", T0)
    t.offer("g", 3, "b3", T0 + 500)  # later arrivals do not restart the grace period
    assert t.resolve_starts(T0 + DISCOVERY_GRACE_MS - 1) == []
    assert t.gateways["g"].next_seq is None
    ready = t.resolve_starts(T0 + DISCOVERY_GRACE_MS)
    assert ready == [("g", 3, "b3"), ("g", 4, "b4")]
    assert t.gateways["g"].next_seq == 5
    assert t.resolve_starts(T0 + 10 * DISCOVERY_GRACE_MS) == []


def test_resolve_starts_leaves_announced_gateways_alone() -> None:
    t = tracker()
    t.note_status(status("g", first=2, next_seq=5), T0)
    t.offer("g", 3, "b3", T0)
    t.offer("h", 9, "h9", T0)
    assert t.resolve_starts(T0 + DISCOVERY_GRACE_MS) == [("h", 9, "h9")]
    assert t.gateways["g"].next_seq == 2
    assert set(t.gateways["g"].pending) == {3}


# -- watermarks --------------------------------------------------------------------------------


def test_watermark_is_the_largest_applied_event_time() -> None:
    t = started(0)
    assert t.watermark("g") is None
    assert t.watermark("unknown") is None
    t.offer("g", 0, "b0", T0)
    t.applied("g", 500, T0)
    assert t.watermark("g") == 500
    t.offer("g", 1, "b1", T0)
    t.applied("g", 300, T0)  # an older batch never moves it back
    assert t.watermark("g") == 500
    t.offer("g", 2, "b2", T0)
    t.applied("g", None, T0)  # an empty or rejected batch
    assert t.watermark("g") == 500
    assert t.gateways["g"].applied == 3
    t.offer("g", 3, "b3", T0)
    t.applied("g", 900, T0)
    assert t.watermark("g") == 900


# -- holding -----------------------------------------------------------------------------------


def gateway(
    t: ProgressTracker[str], gateway_id: str, *, watermark: int | None, at: int
) -> GatewayProgress[str]:
    """A gateway that applied seq 0 (with ``watermark``) at clock ``at``."""
    t.note_status(status(gateway_id, first=0, next_seq=1), at)
    t.offer(gateway_id, 0, "b0", at)
    t.applied(gateway_id, watermark, at)
    return t.gateways[gateway_id]


def test_default_max_hold() -> None:
    assert default_max_hold_ms(2_000, 10_000) == 24_000
    assert ProgressTracker[str](1_000).max_hold_ms == 2_000
    assert ProgressTracker[str](1_000, max_hold_ms=3_000).max_hold_ms == 3_000


def test_refused_batches_are_not_progress() -> None:
    t = tracker()
    g = gateway(t, "g", watermark=500, at=T0)
    t.note_status(status("g", first=1, next_seq=5), T0 + 100)
    for seq in range(1, 4):  # every later batch refused (e.g. clock far ahead)
        t.offer("g", seq, f"b{seq}", T0 + 200)
        t.refused("g")
    assert g.refused == 3
    assert g.applied == 4
    assert g.next_seq == 4
    assert t.watermark("g") == 500
    assert g.last_progress_ms == T0  # unchanged: only accepted input is progress
    # Announced batches (seq 4) do not hold for a gateway whose latest batch was refused;
    # its last accepted progress holds for the idle timeout only.
    assert t.holds(g, T0 + IDLE - 1)
    assert not t.holds(g, T0 + IDLE)


def test_a_gateway_whose_input_is_all_refused_does_not_block_the_others() -> None:
    t = tracker()
    gateway(t, "good", watermark=1_000, at=T0)
    t.note_status(status("bad", first=0, next_seq=3), T0)
    assert t.pipeline_watermark(T0) is None  # a newcomer with batches announced holds...
    t.offer("bad", 0, "b0", T0 + 10)
    t.refused("bad")  # ... until its input turns out to be refused
    t.offer("good", 1, "b1", T0 + 20)
    t.applied("good", 2_000, T0 + 20)
    assert t.pipeline_watermark(T0 + 20) == 2_000


def drifting(lateness: int = 100) -> ProgressTracker[str]:
    return ProgressTracker(IDLE * 100, max_hold_ms=MAX_HOLD, lateness_ms=lateness)


def keep_going(t: ProgressTracker[str], gateway_id: str, seq: int, mark: int, at: int) -> None:
    t.offer(gateway_id, seq, f"b{seq}", at)
    t.applied(gateway_id, mark, at)


def second(t: ProgressTracker[str], step: int, gateways: dict[str, int]) -> int:
    """Clock second ``step``: each gateway delivers seq ``step`` with data this far off now."""
    now = T0 + step * 1_000
    for gateway_id, offset_ms in gateways.items():
        keep_going(t, gateway_id, step, now + offset_ms, now)
    return now


def test_a_gateway_far_behind_holds_the_others_for_max_hold_at_most() -> None:
    t = drifting()
    gateway(t, "on-time", watermark=T0, at=T0)
    behind = gateway(t, "behind", watermark=T0 - 3_600_000, at=T0)
    assert t.pipeline_watermark(T0) == T0 - 3_600_000
    for step in range(1, 6):  # both keep delivering, one second apart
        now = second(t, step, {"on-time": 0, "behind": -3_600_000})
        expected = now - 3_600_000 if step * 1_000 < MAX_HOLD else now
        assert t.pipeline_watermark(now) == expected, step
        assert t.holding_ms("behind") == (step * 1_000 if expected != now else 0)
    assert behind.released
    # Released, it stays out while it is behind; caught up, it holds again.
    now = second(t, 6, {"behind": 0, "on-time": 0})
    assert t.pipeline_watermark(now) == T0 + 6_000
    assert not behind.released


def test_gateways_within_the_lateness_of_each_other_are_never_released() -> None:
    t = drifting(lateness=2_000)
    gateway(t, "a", watermark=T0, at=T0)
    b = gateway(t, "b", watermark=T0 - 1_500, at=T0)
    for step in range(1, 20):
        now = second(t, step, {"a": 0, "b": -1_500})
        assert t.pipeline_watermark(now) == now - 1_500
    assert not b.released
    assert t.holding_ms("b") == 0


def test_a_gateway_behind_because_of_its_backlog_is_never_released() -> None:
    # Under overload a busy gateway's applied event time trails the others: its sealed
    # batches wait in its spool. Its data is as valid as anyone's; it keeps holding.
    t = drifting()
    gateway(t, "quiet", watermark=T0, at=T0)
    busy = gateway(t, "busy", watermark=T0 - 30_000, at=T0)
    for step in range(1, 20):
        now = second(t, step, {"quiet": 0, "busy": -30_000})
        t.note_status(status("busy", first=step, next_seq=step + 50), now)  # 50 waiting
        assert t.pipeline_watermark(now) == now - 30_000
    assert not busy.released
    assert t.holding_ms("busy") == 0


def test_a_clock_running_ahead_cannot_pull_the_reference_along() -> None:
    t = drifting()
    on_time = gateway(t, "on-time", watermark=T0, at=T0)
    gateway(t, "ahead", watermark=T0 + 240_000, at=T0)  # within max_future_ms, say
    for step in range(1, 20):
        now = second(t, step, {"on-time": 0, "ahead": 240_000})
        assert t.pipeline_watermark(now) == now  # the on-time gateway keeps the lead...
    assert not on_time.released  # ... and is never released: the reference is capped at now


def test_recent_progress_holds_then_idles() -> None:
    t = tracker()
    progress = gateway(t, "g", watermark=100, at=T0)
    assert t.holds(progress, T0)
    assert t.holds(progress, T0 + IDLE - 1)
    assert not t.holds(progress, T0 + IDLE)


def test_unapplied_announced_batches_hold_until_max_hold() -> None:
    t = tracker()
    progress = gateway(t, "g", watermark=100, at=T0)
    t.note_status(status("g", first=0, next_seq=3), T0)  # seqs 1 and 2 are on their way
    assert progress.has_unapplied()
    assert t.holds(progress, T0 + IDLE)
    assert t.holds(progress, T0 + MAX_HOLD - 1)
    assert not t.holds(progress, T0 + MAX_HOLD)


def test_pending_batches_hold() -> None:
    t = tracker()
    progress = gateway(t, "g", watermark=100, at=T0)
    t.offer("g", 2, "b2", T0)  # waiting for seq 1
    assert t.holds(progress, T0 + IDLE + 1)
    assert not t.holds(progress, T0 + MAX_HOLD)


def test_progress_renews_the_hold() -> None:
    t = tracker()
    progress = gateway(t, "g", watermark=100, at=T0)
    t.offer("g", 1, "b1", T0 + 900)
    t.applied("g", 200, T0 + 900)
    assert t.holds(progress, T0 + 1_500)
    assert not t.holds(progress, T0 + 900 + IDLE)


def test_pipeline_watermark_is_min_over_holding() -> None:
    t = tracker()
    assert t.pipeline_watermark(T0) is None
    gateway(t, "a", watermark=100, at=T0)
    gateway(t, "b", watermark=250, at=T0)
    assert t.pipeline_watermark(T0) == 100


def test_holding_gateway_without_data_blocks_everything() -> None:
    t = tracker()
    gateway(t, "a", watermark=100, at=T0)
    t.note_status(status("new", first=0, next_seq=0), T0)
    assert t.pipeline_watermark(T0) is None
    # once the silent newcomer goes idle, it stops holding
    t.offer("a", 1, "b1", T0 + IDLE)
    t.applied("a", 400, T0 + IDLE)
    assert t.pipeline_watermark(T0 + IDLE) == 400


def test_idle_gateway_no_longer_holds_the_minimum() -> None:
    t = tracker()
    gateway(t, "slow", watermark=100, at=T0)
    fast = gateway(t, "fast", watermark=5_000, at=T0)
    assert t.pipeline_watermark(T0) == 100
    t.offer("fast", 1, "b1", T0 + IDLE)
    t.applied("fast", 6_000, T0 + IDLE)
    assert fast.watermark_ms == 6_000
    assert t.pipeline_watermark(T0 + IDLE) == 6_000


def test_idle_gateway_with_the_higher_watermark_is_ignored() -> None:
    t = tracker()
    gateway(t, "idle", watermark=9_000, at=T0)
    gateway(t, "busy", watermark=100, at=T0 + IDLE)
    assert t.pipeline_watermark(T0 + IDLE) == 100


def test_all_idle_gives_the_largest_watermark() -> None:
    t = tracker()
    gateway(t, "a", watermark=100, at=T0)
    gateway(t, "b", watermark=700, at=T0)
    gateway(t, "c", watermark=None, at=T0)
    assert t.pipeline_watermark(T0 + IDLE) == 700


def test_all_idle_without_data_gives_none() -> None:
    t = tracker()
    gateway(t, "a", watermark=None, at=T0)
    assert t.pipeline_watermark(T0 + IDLE) is None


def test_gateway_with_unknown_start_holds_while_recent() -> None:
    t = tracker()
    gateway(t, "a", watermark=100, at=T0)
    t.offer("new", 7, "x", T0)  # no status yet
    assert t.pipeline_watermark(T0) is None
    assert t.pipeline_watermark(T0 + MAX_HOLD) is not None


# -- confirmations -----------------------------------------------------------------------------


def test_confirmable() -> None:
    t = tracker()
    assert t.confirmable() == {}
    t.offer("unknown", 3, "x", T0)  # start not known: nothing to confirm
    t.note_status(status("g", first=0, next_seq=4), T0)
    assert t.confirmable() == {}
    t.offer("g", 0, "b0", T0)
    t.offer("g", 2, "b2", T0)
    assert t.confirmable() == {"g": 0}
    t.offer("g", 1, "b1", T0)
    assert t.confirmable() == {"g": 2}
    # a gateway that starts at 5 has 0..4 settled already
    t.note_status(status("h", first=5, next_seq=6), T0)
    assert t.confirmable() == {"g": 2, "h": 4}


@pytest.mark.parametrize(("next_seq", "through"), [(None, -1), (0, -1), (1, 0), (10, 9)])
def test_applied_through(next_seq: int | None, through: int) -> None:
    assert GatewayProgress[str]("g", next_seq, None, T0, T0).applied_through == through


# -- the bounded reorder buffer ----------------------------------------------------------------


def bounded(limit: int, spill: DirectorySpill[str] | None = None) -> ProgressTracker[str]:
    t: ProgressTracker[str] = ProgressTracker(
        IDLE, max_hold_ms=MAX_HOLD, max_pending_weight=limit, weigh=len, spill=spill
    )
    for g in ("a", "b"):
        t.note_status(status(g, first=0), T0)
    return t


def test_a_gap_does_not_let_the_buffer_grow_without_bound() -> None:
    t = bounded(limit=50)
    # Seq 0 of gateway a went missing; 1.. keep coming (10 units each).
    for seq in range(1, 20):
        assert t.offer("a", seq, "x" * 10, T0) == []
        assert t.pending_weight <= 50
    progress = t.gateways["a"]
    assert sorted(progress.pending) == [1, 2, 3, 4, 5]  # the oldest are kept ...
    assert progress.deferred == 14  # ... the newest let go, and counted
    # The missing batch arrives: what was kept drains in order.
    assert [s for s, _ in t.offer("a", 0, "x" * 10, T0)] == [0, 1, 2, 3, 4, 5]
    assert t.pending_weight == 0
    # The let-go batches come again (re-sent by the gateway) and apply in order.
    assert [s for s, _ in t.offer("a", 6, "x" * 10, T0)] == [6]


def test_the_gateway_holding_the_most_gives_way_first() -> None:
    t = bounded(limit=60)
    for seq in range(1, 4):
        t.offer("b", seq, "y" * 10, T0)  # b: 30 units pending behind its own gap
    for seq in range(1, 5):
        t.offer("a", seq, "x" * 10, T0)  # a: 40 units: over the limit by 10
    assert t.pending_weight == 60
    assert t.gateways["a"].deferred == 1
    assert t.gateways["b"].deferred == 0
    assert sorted(t.gateways["a"].pending) == [1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(
    order=st.permutations(list(range(30))),
    limit=st.integers(1, 80),
    redeliveries=st.integers(1, 6),
)
def test_with_redelivery_every_seq_is_released_exactly_once_in_order(
    order: list[int], limit: int, redeliveries: int
) -> None:
    """Whatever the buffer lets go comes again (the gateway re-sends it): still exact."""
    t = bounded(limit=limit)
    released = _resent_until_released(t, order, rounds=redeliveries + 30)
    assert [seq for seq, _ in released] == list(range(30))
    assert t.pending_weight == 0


def _run(t: ProgressTracker[str], ready: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """``ready`` and the rest of its run, released piece by piece as the combiner does."""
    out = list(ready)
    while more := t.release():
        out += [(seq, item) for _, seq, item in more]
    return out


def _resent_until_released(
    t: ProgressTracker[str], order: list[int], rounds: int
) -> list[tuple[int, str]]:
    """Gateway a sends ``order`` again and again (what is unconfirmed) until 30 are out."""
    released: list[tuple[int, str]] = []
    for _ in range(rounds):
        for seq in order:
            if seq >= t.gateways["a"].next_seq:  # the gateway re-sends what is unconfirmed
                released += _run(t, t.offer("a", seq, f"{seq:03d}" * 2, T0))
        if len(released) == 30:
            break
    return released


def text_spill(tmp_path: Path, max_bytes: int) -> DirectorySpill[str]:
    return DirectorySpill(str.encode, bytes.decode, max_bytes=max_bytes, parent=tmp_path)


def test_early_arrivals_beyond_memory_go_to_the_spill_and_come_back_in_order(
    tmp_path: Path,
) -> None:
    spill = text_spill(tmp_path, max_bytes=100)
    t = bounded(limit=50, spill=spill)
    # Seq 0 of gateway a is slow (queued at a busy worker); 1.. overtake it.
    items = {seq: f"{seq:02d}" * 5 for seq in range(20)}  # 10 units each
    for seq in range(1, 20):
        assert t.offer("a", seq, items[seq], T0) == []
        assert t.pending_weight <= 50  # memory stays bounded ...
    progress = t.gateways["a"]
    # 5 in memory, 10 in the spill (100 bytes: full), the 4 newest let go
    assert sorted(progress.pending) == list(range(1, 16))
    assert (t.spilled, t.spilled_total, spill.bytes) == (10, 10, 100)
    assert progress.deferred == 4
    assert len(list(tmp_path.glob("shoal-spill-*/*"))) == 10
    assert t.gaps(10) == {"a": (0,)}  # spilled early arrivals are not gaps
    # The slow batch arrives: everything drains in seq order, with the items it was given,
    # what waited in the spill read back at most about the memory bound at a time: 0-5 from
    # memory and 6-10 from the spill (50 units) first, then 11-15.
    ready = t.offer("a", 0, items[0], T0)
    assert ready == [(seq, items[seq]) for seq in range(11)]
    assert t.spilled == 5
    assert t.release() == [("a", seq, items[seq]) for seq in range(11, 16)]
    assert t.release() == []
    assert (t.spilled, spill.bytes, t.pending_weight) == (0, 0, 0)
    assert list(tmp_path.glob("shoal-spill-*/*")) == []


def test_a_spilled_early_arrival_is_a_duplicate_when_it_comes_again_and_goes_when_stale(
    tmp_path: Path,
) -> None:
    spill = text_spill(tmp_path, max_bytes=1_000)
    t = bounded(limit=10, spill=spill)
    for seq in (2, 3, 4):
        t.offer("b", seq, "y" * 10, T0)
    assert t.spilled == 2
    assert t.offer("b", 4, "y" * 10, T0) == []  # a re-sent copy of a spilled batch
    assert t.gateways["b"].duplicates == 1
    # The gateway says 0..3 were confirmed elsewhere: 2 and 3 (spilled) are stale, and the
    # spilled 4 is next.
    assert t.note_status(status("b", first=4, next_seq=5), T0) == [(4, "y" * 10)]
    assert t.gateways["b"].next_seq == 5
    assert (t.spilled, spill.bytes) == (0, 0)
    t.reset()
    spill.close()
    assert list(tmp_path.glob("shoal-spill-*")) == []


@settings(max_examples=100, deadline=None)
@given(
    order=st.permutations(list(range(30))),
    limit=st.integers(1, 80),
    spill_bytes=st.integers(0, 120),
)
def test_with_a_spill_every_seq_is_released_exactly_once_in_order_with_its_item(
    tmp_path_factory: pytest.TempPathFactory, order: list[int], limit: int, spill_bytes: int
) -> None:
    spill = text_spill(tmp_path_factory.mktemp("spill"), max_bytes=spill_bytes)
    t = bounded(limit=limit, spill=spill)
    released = _resent_until_released(t, order, rounds=40)
    assert released == [(seq, f"{seq:03d}" * 2) for seq in range(30)]
    assert (t.pending_weight, t.spilled, spill.bytes) == (0, 0, 0)
    spill.close()


def test_with_no_memory_for_early_arrivals_a_spilled_run_still_moves_one_at_a_time(
    tmp_path: Path,
) -> None:
    spill = text_spill(tmp_path, max_bytes=1_000)
    t = bounded(limit=0, spill=spill)
    for seq in range(1, 4):
        assert t.offer("a", seq, f"x{seq}", T0) == []
    assert t.spilled == 3
    # Batch 0 (its turn at once) and one read back; then one read back per call.
    assert t.offer("a", 0, "x0", T0) == [(0, "x0"), (1, "x1")]
    assert t.release() == [("a", 2, "x2")]
    assert t.release() == [("a", 3, "x3")]
    assert t.release() == []
    assert (t.spilled, spill.bytes) == (0, 0)
