"""Late corrections for session windows: a late piece within ``allowed_lateness_ms`` folds into
the (extended, moved or merged) session; the message of its start is published again with the
next revision, and a session that moved to an earlier start leaves a retraction behind in the
message of its old start (docs/guarantees.md, "Session windows")."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.combine import Combiner
from shoal.processors.results import key_messages, split_windows
from shoal.processors.session_state import SessionState
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.state import ClosedWindows
from shoal.schemas.results import RETRACTED, latest_revisions
from tests.support.crash_replay import Deliveries, message_rows
from tests.support.datasets import make_batches
from tests.support.in_memory import check_against_oracle
from tests.unit.processors.test_combiner import Harness, status

GAP = 1_000
LATENESS = 500
ALLOWED = 5_000
WINDOW = f"session-{GAP // 1_000}s"


def session_spec(allowed_ms: int = ALLOWED, partitions: int = 1, **changes: Any) -> PipelineSpec:
    raw: dict[str, Any] = {
        "name": "c",
        "windows": [{"kind": "session", "gap_ms": GAP, "max_duration_ms": 3_600_000}],
        "aggregates": ["count", "sum", "min", "max", "p50"],
        "lateness_ms": LATENESS,
        "idle_timeout_ms": 1_000,
        "allowed_lateness_ms": allowed_ms,
        "partitions": partitions,
    }
    return parse_pipeline({**raw, **changes})


def published(closed: ClosedWindows | None) -> list[tuple[int, int, str, int, int | None]]:
    """(start, revision, key, rows, superseded_by) of every result row of a step."""
    assert closed is not None
    out = []
    for result in split_windows(closed.frame, closed.revisions, closed.sessions):
        moved = result.frame[RETRACTED] if RETRACTED in result.frame.columns else None
        for i, (key, rows) in enumerate(result.frame.select("key", "rows").rows()):
            retracted = None if moved is None else moved[i]
            out.append((result.start, result.revision, key, rows, retracted))
    return sorted(out)


def first_close(h: Harness, rows: list[tuple[str, int, float]], far: int) -> ClosedWindows:
    """Sessions of ``rows`` (seq 0), closed by a row of key ``z`` at ``far`` (seq 1)."""
    h.announce("gw")
    h.send("gw", 0, rows)
    h.send("gw", 1, [("z", far, 0.0)])
    closed = h.combiner.tick().closed
    assert closed is not None
    assert closed.revisions == {}
    return closed


def test_session_windows_now_take_allowed_lateness() -> None:
    assert session_spec().allowed_lateness_ms == ALLOWED


def test_a_late_piece_extending_a_closed_session_publishes_a_correction() -> None:
    h = Harness(session_spec())
    closed = first_close(h, [("k", 1_000, 1.0), ("k", 1_200, 2.0)], far=4_000)
    assert published(closed) == [(1_000, 1, "k", 2, None)]
    # 1_900 + gap + lateness <= 4_000 (behind), but within the allowance: folds in
    step = h.send("gw", 2, [("k", 1_900, 4.0)])
    assert step.late == []
    # the session now ends later: it may close (and be published again) at 1_900 + 2 gaps
    assert h.combiner.tick().closed is None
    h.send("gw", 3, [("z", 4_400, 0.0)])  # threshold 3_900
    revised = h.combiner.tick().closed
    assert published(revised) == [(1_000, 2, "k", 3, None)]
    assert revised is not None
    row = revised.frame.row(0, named=True)
    assert (row["end"], row["sum"]) == (2_900, 7.0)
    assert h.combiner.counters.corrections_emitted == 1
    assert h.combiner.tick().closed is None  # published once


def test_a_session_moved_to_an_earlier_start_is_retracted_from_its_old_message() -> None:
    h = Harness(session_spec())
    closed = first_close(h, [("k", 1_000, 1.0), ("k", 1_200, 2.0), ("j", 1_000, 5.0)], far=4_000)
    h.send("gw", 2, [("k", 300, 4.0)])  # 1_000 - 300 < gap: k's session now starts at 300
    revised = h.combiner.tick().closed
    assert published(revised) == [
        (300, 1, "k", 3, None),  # the session under its new start (its first publication)
        (1_000, 2, "j", 1, None),  # the old start's message again, j unchanged
        (1_000, 2, "k", 0, 300),  # k retracted: superseded by the session at 300
    ]
    assert revised is not None
    split = split_windows(revised.frame, revised.revisions, revised.sessions)
    results = {r.start: r for r in split}
    retraction = results[1_000].frame.filter(pl.col("key") == "k").row(0, named=True)
    assert (retraction["end"], retraction["batches"], retraction["count"]) == (2_200, 0, 0)
    assert retraction["sum"] is None
    # no retained per-key message for a retraction; a message without one has no such column
    assert [k for k, _ in key_messages(results[1_000], "c", 0)] == ["j"]
    assert RETRACTED not in results[300].frame.columns
    # a consumer keeping the latest revision per row sees k once, at 300, with every row
    rows = _consumer_rows(closed, revised)
    assert rows.filter(pl.col("key") == "k").select("start", "rows").rows() == [(300, 3)]


def _consumer_rows(*steps: ClosedWindows | None) -> pl.DataFrame:
    """What a consumer keeping the latest revision per result row holds after ``steps``."""
    frames = []
    for closed in steps:
        assert closed is not None
        frames.extend(message_rows(closed))
    return latest_revisions(pl.concat(frames, how="diagonal_relaxed"))


def test_a_late_piece_bridging_two_closed_sessions_merges_them() -> None:
    h = Harness(session_spec())
    closed = first_close(
        h,
        [("k", 1_000, 1.0), ("k", 1_200, 1.0), ("k", 2_500, 1.0), ("m", 2_500, 9.0)],
        far=6_000,
    )
    assert published(closed) == [
        (1_000, 1, "k", 2, None),
        (2_500, 1, "k", 1, None),
        (2_500, 1, "m", 1, None),
    ]
    h.send("gw", 2, [("k", 1_900, 1.0)])  # less than a gap from both: one session
    revised = h.combiner.tick().closed
    assert published(revised) == [
        (1_000, 2, "k", 4, None),
        (2_500, 2, "k", 0, 1_000),
        (2_500, 2, "m", 1, None),
    ]
    latest = _consumer_rows(closed, revised).sort("start", "key")
    assert latest.select("start", "key", "rows").rows() == [(1_000, "k", 4), (2_500, "m", 1)]


def test_beyond_the_allowance_a_piece_stays_late() -> None:
    h = Harness(session_spec(allowed_ms=1_000))
    first_close(h, [("k", 1_000, 1.0)], far=4_000)
    # 1_900 + gap + lateness + 1_000 <= 4_400: beyond, by the gateway's own rule
    h.send("gw", 2, [("z", 4_400, 0.0)])
    step = h.send("gw", 3, [("k", 1_900, 4.0)])
    [late] = step.late
    assert late.frame.select("start", "reason").rows() == [(1_900, "behind_watermark")]
    assert h.combiner.counters.rows_late == 1


def test_duplicates_make_no_revision_and_restarts_resume_the_counts() -> None:
    h = Harness(session_spec())
    first_close(h, [("k", 1_000, 1.0)], far=4_000)
    late = h.partial("gw", 2, [("k", 300, 4.0)])
    h.combiner.receive(late)
    assert published(h.combiner.tick().closed) == [
        (300, 1, "k", 2, None),
        (1_000, 2, "k", 0, 300),
    ]
    for _ in range(3):
        assert h.combiner.receive(late).applied == 0
        assert h.combiner.tick().closed is None
    # a checkpoint keeps the published sessions, their starts and revisions
    snapshot = h.combiner.snapshot()
    h2 = Harness(session_spec())
    h2.combiner.restore(snapshot)
    h2.send("gw", 3, [("k", 1_500, 1.0)])  # extends [300, 1_000]: a correction of 300
    assert published(h2.combiner.tick().closed) == [(300, 2, "k", 3, None)]


def test_a_merge_before_the_first_close_is_no_correction() -> None:
    """A late piece folded in while the sessions are still open changes nothing published."""
    h = Harness(session_spec())
    h.announce("gw")
    h.announce("slow")
    h.send("slow", 0, [("s", 0, 0.0)])  # holds the threshold back
    h.send("gw", 0, [("k", 1_000, 1.0), ("k", 2_500, 1.0)])
    h.send("gw", 1, [("z", 6_000, 0.0)])
    h.send("gw", 2, [("k", 1_900, 1.0)])  # behind, bridges two open sessions
    assert h.combiner.tick().closed is None
    h.send("slow", 1, [("s", 9_000, 0.0)])
    closed = h.combiner.tick().closed
    assert [r for r in published(closed) if r[2] == "k"] == [(1_000, 1, "k", 3, None)]


def test_closed_sessions_are_kept_only_for_the_allowed_lateness() -> None:
    h = Harness(session_spec(allowed_ms=2_000))
    first_close(h, [("k", 1_000, 1.0)], far=4_000)  # threshold 3_500: k closed at 3_000
    assert h.combiner.kept_windows() == 1
    h.send("gw", 2, [("z", 5_499, 0.0)])  # threshold 4_999 < 3_000 + 2_000: kept
    h.combiner.tick()
    assert h.combiner.kept_windows() >= 1
    assert (0, 1_000) in h.combiner.sessions.published
    h.send("gw", 3, [("z", 5_500, 0.0)])  # threshold 5_000: k's session goes
    h.combiner.tick()
    assert (0, 1_000) not in h.combiner.sessions.published
    assert "k" not in _held_keys(h)


def _held_keys(h: Harness) -> list[str]:
    rows = h.combiner.sessions.snapshot_rows()
    return [] if rows is None else [str(k) for k in rows.keys]


def test_having_never_withholds_a_retraction() -> None:
    h = Harness(session_spec(having="rows >= 2"))
    first_close(h, [("k", 1_000, 1.0), ("k", 1_100, 1.0), ("j", 1_000, 1.0)], far=4_000)
    h.send("gw", 2, [("k", 300, 4.0)])
    assert published(h.combiner.tick().closed) == [
        (300, 1, "k", 3, None),
        (1_000, 2, "k", 0, 300),  # j withheld (one row), k's retraction kept
    ]


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_latest_revisions_equal_the_oracle(
    partitions: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nearly in order, so sessions close while late pieces still come: corrections flow,
    sessions move to earlier starts (retractions) and pieces beyond the allowance are late."""
    retractions = _count_retractions(monkeypatch)
    spec = session_spec(
        allowed_ms=5_000,
        partitions=partitions,
        lateness_ms=300,
        windows=[{"kind": "session", "gap_ms": 1_500, "max_duration_ms": 8_000}],
    )
    batches = make_batches(
        seed=partitions * 7 + workers,
        gateways=3,
        batches_per_gateway=25,
        gap_every=3,
        keys=20,
        late_fraction=0.2,
        late_by_ms=(500, 9_000),
    )
    combiners = check_against_oracle(spec, batches, seed=workers, workers=workers, reorder_within=4)
    assert sum(c.counters.corrections_emitted for c in combiners) > 0
    assert sum(c.counters.rows_late for c in combiners) > 0
    assert retractions[0] > 0


def _count_retractions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the retraction rows the sessions publish (a spy on the real method)."""
    seen = [0]
    real = SessionState._with_retractions

    def counting(self: SessionState, *args: Any) -> pl.DataFrame:
        frame = real(self, *args)
        if RETRACTED in frame.columns:
            seen[0] += int(frame[RETRACTED].is_not_null().sum())
        return frame

    monkeypatch.setattr(SessionState, "_with_retractions", counting)
    return seen


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gateways=st.integers(1, 3),
    batches=st.integers(1, 12),
    gap_ms=st.sampled_from([300, 700, 1_400]),
    allowed_ms=st.sampled_from([300, 1_500, 6_000]),
    keys=st.sampled_from([6, 20]),
    late_by=st.sampled_from([(500, 20_000), (500, 6_000)]),
    partitions=st.integers(1, 2),
    duplicate_fraction=st.floats(0.0, 1.0),
    reorder_within=st.sampled_from([2, 4, 8]),
)
def test_property_corrections_are_exact(
    seed: int,
    gateways: int,
    batches: int,
    gap_ms: int,
    allowed_ms: int,
    keys: int,
    late_by: tuple[int, int],
    partitions: int,
    duplicate_fraction: float,
    reorder_within: int,
) -> None:
    spec = session_spec(
        allowed_ms=allowed_ms,
        partitions=partitions,
        windows=[{"kind": "session", "gap_ms": gap_ms, "max_duration_ms": 20_000}],
    )
    data = make_batches(
        seed=seed,
        gateways=gateways,
        batches_per_gateway=batches,
        gap_every=3,
        keys=keys,
        late_by_ms=late_by,
    )
    check_against_oracle(
        spec, data, seed=seed, duplicate_fraction=duplicate_fraction, reorder_within=reorder_within
    )


def _session_restart(*, with_log: bool) -> tuple[list[str], list[tuple[int, str, int]]]:
    """Session corrections in the timing-dependent case, a crash, re-sends in another order.

    Gateways b and c go quiet; a closes k's and j's sessions without them. b's next piece
    extends k's session (a correction of its start), c's moves j's session to an earlier
    start (a retraction and a new message); both are on time by their gateways' own rule
    and come after the close only by timing. The combiner dies; its checkpoint (taken
    before the close) is restored, the gateways re-send c1, b1, a1 in that order, then b
    sends a new row for k's session. Returns the (start, revision) published with two
    different contents, and the (start, key, rows) a consumer keeping the latest revision
    per result row holds.
    """
    spec = session_spec(idle_timeout_ms=1_000)
    h = Harness(spec)
    run = Deliveries(h.partial, columns=("key", "rows"))
    deliver, persist, publish = run.deliver, run.persist, run.publish
    for gateway_id, next_seq in (("a", 2), ("b", 1), ("c", 1)):
        h.combiner.receive_status(status(gateway_id, 0, next_seq))
    deliver(h.combiner, "a", 0, ("k", 5_100))
    deliver(h.combiner, "b", 0, ("k", 5_200))
    deliver(h.combiner, "c", 0, ("j", 5_300))
    checkpoint = h.combiner.snapshot()
    persist(h.combiner)
    h.clock.advance(1_001)  # b and c go quiet
    deliver(h.combiner, "a", 1, ("z", 9_000))  # threshold 8_500: k's and j's sessions close
    deliver(h.combiner, "b", 1, ("k", 5_400))  # after the close: k's session grows
    deliver(h.combiner, "c", 1, ("j", 4_800))  # after the close: j's session moves to 4_800
    assert {(s, r) for s, r in run.copies if s != 9_000} == {
        (4_800, 1),
        (5_100, 1),
        (5_100, 2),
        (5_300, 1),
        (5_300, 2),
    }

    restored = Combiner(spec, 0, h.clock)
    restored.restore(checkpoint, bytes(run.log) if with_log else None)
    for gateway_id, seq, row in (("c", 1, ("j", 4_800)), ("b", 1, ("k", 5_400))):
        deliver(restored, gateway_id, seq, row)
    deliver(restored, "a", 1, ("z", 9_000))
    deliver(restored, "b", 2, ("k", 5_600))  # new after the crash
    h.clock.advance(1_001)
    publish(restored.tick().closed)
    conflicting = [f"{s}/{r}" for s, r in run.conflicting()]
    latest = latest_revisions(pl.concat(run.messages, how="diagonal_relaxed"))
    return conflicting, sorted(latest.select("start", "key", "rows").rows())


def test_a_restart_re_takes_session_corrections_whatever_the_resend_order() -> None:
    conflicting, latest = _session_restart(with_log=True)
    assert conflicting == []  # one content per (start, revision)
    # every row once: k's session with b's row sent after the crash, j's at its new start
    assert [r for r in latest if r[1] != "z"] == [(4_800, "j", 2), (5_100, "k", 4)]


def test_without_the_close_log_the_session_restart_goes_wrong() -> None:
    conflicting, latest = _session_restart(with_log=False)
    # the restored combiner takes b's and c's pieces on time and publishes k's whole
    # session as revision 1 again, with other rows; the consumer keeps the revision 2 from
    # before the crash, which lacks the row b sent after it
    assert conflicting == ["5100/1"]
    assert [r for r in latest if r[1] != "z"] == [(4_800, "j", 2), (5_100, "k", 3)]
