"""Late corrections in the combiner core: which rows fold in, revisions, memory, checkpoints."""

from __future__ import annotations

import pytest

from shoal.errors import ConfigError
from shoal.processors.combine import Combiner, _partial_bytes
from tests.support.crash_replay import Deliveries
from tests.unit.processors.test_combiner import IDLE, LATENESS, Harness, make_spec, status

ALLOWED = 3_000
SPEC = make_spec(allowed_lateness_ms=ALLOWED)


def closed_window(h: Harness) -> None:
    """gw closes [5_000, 6_000): its watermark moves to 7_000 (threshold 6_500)."""
    h.announce("gw")
    h.send("gw", 0, [("k", 5_100, 1.0), ("j", 5_200, 10.0)])
    h.send("gw", 1, [("k", 7_000, 2.0)])
    step = h.combiner.tick()
    assert step.closed is not None
    assert step.closed.frame.select("start", "key", "count").sort("key").rows() == [
        (5_000, "j", 1),
        (5_000, "k", 1),
    ]
    assert step.closed.revisions == {}  # revision 1


def test_the_setting_is_validated() -> None:
    assert make_spec().allowed_lateness_ms == 0
    with pytest.raises(ConfigError, match="allowed_lateness_ms"):
        make_spec(allowed_lateness_ms=-1)
    with pytest.raises(ConfigError, match="allowed_lateness_ms"):
        make_spec(allowed_lateness_ms="1s")


def test_a_row_within_the_allowance_folds_in_and_revises_the_window() -> None:
    h = Harness(SPEC)
    closed_window(h)
    # 6_000 + 500 <= 7_000 (late by the lateness rule) but 6_000 + 500 + 3_000 > 7_000
    step = h.send("gw", 2, [("k", 5_300, 4.0)])
    assert step.late == []
    revised = h.combiner.close_ready(h.clock.now_ms())
    assert revised is not None
    assert revised.revisions == {("tumbling-1s", 5_000): 2}
    # the whole window again (every key of the partition), the late row counted
    assert revised.frame.select("start", "key", "count", "sum").sort("key").rows() == [
        (5_000, "j", 1, 10.0),
        (5_000, "k", 2, 5.0),
    ]
    assert h.combiner.counters.rows_corrected == 1
    assert h.combiner.counters.corrections_emitted == 1
    assert h.combiner.close_ready(h.clock.now_ms()) is None  # published once


def test_beyond_the_allowance_rows_stay_late() -> None:
    h = Harness(SPEC)
    closed_window(h)
    h.send("gw", 2, [("k", 9_600, 0.0)])  # gw's watermark 9_600: threshold 9_100
    # 6_000 + 500 + 3_000 <= 9_600: beyond the allowance by the gateway's own rule
    step = h.send("gw", 3, [("k", 5_400, 4.0)])
    [late] = step.late
    assert late.frame.select("start", "reason").rows() == [(5_000, "behind_watermark")]
    assert h.combiner.counters.rows_late == 1
    assert h.combiner.counters.rows_corrected == 0


def test_duplicates_and_resends_make_no_revision() -> None:
    h = Harness(SPEC)
    closed_window(h)
    late = h.partial("gw", 2, [("k", 5_300, 4.0)])
    h.combiner.receive(late)
    assert h.combiner.close_ready(h.clock.now_ms()) is not None
    for _ in range(3):
        step = h.combiner.receive(late)
        assert step.applied == 0
        assert h.combiner.close_ready(h.clock.now_ms()) is None
    assert h.combiner.revisions == {(0, 5_000): 1}


def test_revisions_count_late_batches_whenever_they_arrived() -> None:
    """Two late batches folded before one publish: the revision says 3 (it may skip)."""
    h = Harness(SPEC)
    closed_window(h)
    h.send("gw", 2, [("k", 5_300, 4.0)])
    h.send("gw", 3, [("k", 5_400, 8.0)])
    revised = h.combiner.close_ready(h.clock.now_ms())
    assert revised is not None
    assert revised.revisions == {("tumbling-1s", 5_000): 3}
    # Behind rows folded while the window is still open count as well: the same content
    # always carries the same revision, whether the close came before or after them.
    h2 = Harness(SPEC)
    h2.announce("gw")
    h2.announce("slow")  # holds the window open
    h2.send("slow", 0, [("k", 5_000, 0.0)])
    h2.send("gw", 0, [("k", 5_100, 1.0), ("j", 5_200, 10.0)])
    h2.send("gw", 1, [("k", 7_000, 2.0)])
    h2.send("gw", 2, [("k", 5_300, 4.0)])
    h2.send("gw", 3, [("k", 5_400, 8.0)])
    assert h2.combiner.tick().closed is None
    h2.send("slow", 1, [("k", 7_000, 0.0)])
    closed = h2.combiner.tick().closed
    assert closed is not None
    assert closed.revisions == {("tumbling-1s", 5_000): 3}


def test_closed_windows_are_kept_only_for_the_allowed_lateness() -> None:
    h = Harness(SPEC)
    closed_window(h)
    assert h.combiner.kept_windows() == 1
    h.send("gw", 2, [("k", 9_499, 0.0)])  # threshold 8_999: 6_000 + 3_000 > 8_999, kept
    h.combiner.tick()
    assert h.combiner.kept_windows() == 2  # [5_000, 6_000) and [7_000, 8_000)
    h.send("gw", 3, [("k", 9_500, 0.0)])  # threshold 9_000: [5_000, 6_000) goes
    h.combiner.tick()
    assert h.combiner.counters.windows_dropped == 1
    assert h.combiner.kept_windows() == 1
    assert (0, 5_000) not in h.combiner.revisions
    # An idle gateway's row for the dropped window is late (window_closed), as without
    # corrections; for a kept window it folds in.
    h.announce("idle")
    step = h.send("idle", 0, [("k", 5_500, 1.0), ("k", 7_500, 1.0)])
    [late] = step.late
    assert late.frame.select("start", "reason").rows() == [(5_000, "window_closed")]
    revised = h.combiner.close_ready(h.clock.now_ms())
    assert revised is not None
    assert revised.revisions == {("tumbling-1s", 7_000): 2}


def test_kept_windows_and_revisions_survive_a_checkpoint() -> None:
    h = Harness(SPEC)
    closed_window(h)
    h.send("gw", 2, [("k", 5_300, 4.0)])
    first = h.combiner.close_ready(h.clock.now_ms())
    snapshot = h.combiner.snapshot()
    restored = Harness(SPEC)
    restored.combiner.restore(snapshot)
    assert restored.combiner.revisions == {(0, 5_000): 1}
    assert restored.combiner.kept_windows() == 1
    # the batch after the checkpoint is re-sent to both: the same revision, the same values
    again = []
    for harness in (h, restored):
        harness.send("gw", 3, [("k", 5_400, 8.0)])
        again.append(harness.combiner.close_ready(harness.clock.now_ms()))
    assert first is not None
    assert again[0] is not None
    assert again[1] is not None
    assert again[0].revisions == again[1].revisions == {("tumbling-1s", 5_000): 3}
    assert again[0].frame.equals(again[1].frame)


def test_without_allowed_lateness_nothing_is_kept() -> None:
    h = Harness()
    h.announce("gw")
    h.send("gw", 0, [("k", 5_100, 1.0)])
    h.send("gw", 1, [("k", 7_000, 2.0)])
    h.tick()
    step = h.send("gw", 2, [("k", 5_300, 4.0)])
    assert [item.rows for item in step.late] == [1]
    assert h.combiner.kept_windows() == 0
    assert h.combiner.close_ready(h.clock.now_ms()) is None
    assert LATENESS == 500


def _restart_with_resends_in_another_order(*, with_log: bool) -> tuple[list[str], dict[str, int]]:
    """Corrections in the timing-dependent case, a crash, re-sends in another order.

    Gateways b and c go quiet, a closes [5_000, 6_000) without them; b's and c's next
    batches are on time by their own rule but come after the close, so each is a correction
    (revisions 2 and 3). The combiner then dies and its checkpoint (taken before the close)
    is restored; the gateways re-send c1, b1, a1 in that order, then b sends a new row for
    the window. Returns the identities published with two different contents, and the
    window's rows per key in the copy a consumer keeps (highest revision, then most rows).
    """
    h = Harness(SPEC)
    run = Deliveries(h.partial)
    deliver, persist, publish = run.deliver, run.persist, run.publish
    for gateway_id, next_seq in (("a", 2), ("b", 1), ("c", 1)):
        h.combiner.receive_status(status(gateway_id, 0, next_seq))
    deliver(h.combiner, "a", 0, ("k", 5_100))
    deliver(h.combiner, "b", 0, ("k", 5_200))
    deliver(h.combiner, "c", 0, ("j", 5_300))
    checkpoint = h.combiner.snapshot()
    persist(h.combiner)
    h.clock.advance(IDLE + 1)  # b and c go quiet
    deliver(h.combiner, "a", 1, ("k", 7_000))  # threshold 6_500: [5_000, 6_000) closes
    deliver(h.combiner, "b", 1, ("k", 5_400))  # after the close: revision 2
    deliver(h.combiner, "c", 1, ("j", 5_500))  # revision 3
    assert {r for _, r in run.copies} == {1, 2, 3}

    restored = Combiner(SPEC, 0, h.clock)
    restored.restore(checkpoint, bytes(run.log) if with_log else None)
    for gateway_id, seq, row in (("c", 1, ("j", 5_500)), ("b", 1, ("k", 5_400))):
        deliver(restored, gateway_id, seq, row)
    deliver(restored, "a", 1, ("k", 7_000))
    deliver(restored, "b", 2, ("k", 5_600))  # new after the crash
    h.clock.advance(IDLE + 1)
    publish(restored.tick().closed)

    conflicting = [f"revision {r}" for _, r in run.conflicting()]
    kept = max(
        (revision, sum(int(str(n)) for _, n in content), content)
        for (_, revision), seen in run.copies.items()
        for content in seen
    )
    return conflicting, {str(k): int(str(n)) for k, n in kept[2]}


def test_a_restart_re_takes_logged_closes_whatever_the_resend_order() -> None:
    conflicting, kept = _restart_with_resends_in_another_order(with_log=True)
    assert conflicting == []  # one content per (window, revision)
    assert kept == {"j": 2, "k": 4}  # every row, the one sent after the crash included


def test_without_the_close_log_the_same_restart_publishes_conflicting_copies() -> None:
    conflicting, kept = _restart_with_resends_in_another_order(with_log=False)
    assert conflicting == ["revision 1"]
    assert kept == {"j": 2, "k": 3}  # the consumer keeps revision 3: b's new row is missing


def _logged_correction() -> tuple[Harness, bytes, bytes]:
    """A checkpoint, then a close without the quiet gateway b and b's correction, logged.

    Returns the harness, the checkpoint and the close log's file: a combiner restored from
    them re-takes the close (it waits for a1) and then the correction (it waits for b1).
    """
    h = Harness(SPEC)
    run = Deliveries(h.partial)
    for gateway_id, next_seq in (("a", 2), ("b", 1)):
        h.combiner.receive_status(status(gateway_id, 0, next_seq))
    h.send("a", 0, [("k", 5_100, 1.0)])
    h.send("b", 0, [("k", 5_200, 1.0)])
    checkpoint = h.combiner.snapshot()
    h.clock.advance(IDLE + 1)
    h.send("a", 1, [("k", 7_000, 1.0)])
    assert h.combiner.tick().closed is not None  # b quiet: the window closes without it
    h.send("b", 1, [("k", 5_400, 1.0)])  # a correction
    h.combiner.tick()
    run.persist(h.combiner)
    return h, checkpoint, bytes(run.log)


def test_a_replay_waits_while_its_gateway_sends_and_is_given_up_when_it_is_silent() -> None:
    h, checkpoint, log = _logged_correction()

    restored = Combiner(SPEC, 0, h.clock)
    restored.restore(checkpoint, log)
    restored.receive(h.partial("b", 1, [("k", 5_400, 1.0)]))  # held: a1 comes first
    bound = SPEC.hold_bound_ms
    for _ in range(3):  # a re-sends its old batch (a duplicate): it is alive, keep waiting
        h.clock.advance(bound - 1)
        restored.receive(h.partial("a", 0, [("k", 5_100, 1.0)]))
        assert restored.tick().closed is None
        assert restored.replaying
    h.clock.advance(bound)  # then a falls silent: the replay is given up
    step = restored.tick()
    assert not restored.replaying
    assert restored.counters.replays_abandoned == 1
    assert step.applied == 1  # b1, held until then


def test_batches_held_during_a_replay_are_bounded_and_the_newest_come_again() -> None:
    h, checkpoint, log = _logged_correction()

    b1, b2 = h.partial("b", 1, [("k", 5_400, 1.0)]), h.partial("b", 2, [("k", 7_100, 2.0)])
    one = _partial_bytes(b1)
    restored = Combiner(SPEC, 0, h.clock, max_pending_bytes=one + one // 2)  # room for one
    restored.restore(checkpoint, log)
    restored.receive(b1)  # held: the logged close waits for a1
    restored.receive(b2)  # held too, over the bound: let go, b's next seq steps back
    progress = restored.tracker.gateways["b"]
    assert (progress.deferred, progress.next_seq) == (1, 2)
    assert restored.held_weight <= one + one // 2
    # a1 is held too, which passes the bound again: b's newest held batch (b1) goes
    restored.receive(h.partial("a", 1, [("k", 7_000, 1.0)]))
    assert (progress.deferred, progress.next_seq) == (2, 1)
    assert restored.replaying  # the first logged close ran; the second waits for b1
    restored.receive(b1)  # b sends again what was never confirmed, oldest first
    assert not restored.replaying
    assert restored.counters.closes_replayed == 2
    restored.receive(b2)
    assert restored.counters.batches_applied == 5  # a0, b0 (checkpoint), a1, b1, b2
    assert progress.duplicates == 0
    assert restored.held_weight == 0
