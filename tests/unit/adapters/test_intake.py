"""The intake log: rows logged but not sealed come back after a crash; redeliveries once."""

from __future__ import annotations

from pathlib import Path

from shoal.adapters import intake
from shoal.adapters.intake import IntakeLog

ROW_A = ("s1", 1, 1.0, "t", None, None)
ROW_B = ("s1", 2, 2.0, "t", None, None)
ROW_C = ("s2", 3, 3.0, None, None, "C")


def test_rows_after_the_last_completed_seal_come_back(tmp_path: Path) -> None:
    path = tmp_path / "intake.log"
    first = IntakeLog(path)
    assert first.recover(next_seq=0) == []
    first.append([ROW_A], [(1, "t/a", 11)])
    first.seal_begin(0)  # sealed: the gateway's next seq moved on to 1
    first.append([ROW_B], [(2, "t/a", 12)])
    first.seal_begin(1)  # this seal did not reach the spool (crash)
    first.append([ROW_C], [(3, "t/b", 13)])
    # no close: a kill -9
    again = IntakeLog(path)
    assert again.recover(next_seq=1) == [ROW_B, ROW_C]
    third = IntakeLog(path)
    assert third.recover(next_seq=2) == [ROW_C]  # had the second seal completed


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "intake.log"
    log = IntakeLog(path)
    log.recover(0)
    log.append([ROW_A], [(1, "t", 1)])
    with path.open("ab") as fh:
        fh.write(b'{"rows": [["s')
    assert IntakeLog(path).recover(0) == [ROW_A]


def test_redeliveries_of_the_last_groups_are_dropped_once(tmp_path: Path) -> None:
    log = IntakeLog(tmp_path / "intake.log", horizon=3)  # the Receive Maximum
    log.recover(0)
    log.append([ROW_A], [(1, "t", 1)])
    log.append([ROW_B], [(2, "t", 2), (3, "t", 3)])
    log.append([ROW_C], [(4, "t", 4)])
    log.arm()
    assert log.is_redelivery((2, "t", 2))
    assert not log.is_redelivery((2, "t", 2))  # once only
    assert log.is_redelivery((4, "t", 4))
    log.arm()
    # the broker holds at most 3 unacknowledged messages: 2, 3 and 4 at most
    assert not log.is_redelivery((1, "t", 1))
    assert not log.is_redelivery((4, "t", 99))  # same packet id, other payload
    log.arm()
    for _ in range(3):
        log.is_redelivery((9, "x", 9))
    assert not log.is_redelivery((3, "t", 3))  # beyond the horizon
    # after a restart, the groups come from the file
    again = IntakeLog(tmp_path / "intake.log")
    again.recover(0)
    again.arm()
    assert again.is_redelivery((4, "t", 4))


def test_small_groups_are_kept_until_they_cover_the_receive_maximum(tmp_path: Path) -> None:
    # Groups of one message each: PUBACK writes still queued could span more than two
    # groups, so the log keeps as many groups as the broker can hold unacknowledged.
    log = IntakeLog(tmp_path / "intake.log", horizon=3)
    log.recover(0)
    for mid in range(1, 6):
        log.append([ROW_A], [(mid, "t", mid)])
    log.arm()
    assert [log.is_redelivery((m, "t", m)) for m in range(3, 6)] == [True, True, True]
    log.arm()
    assert not log.is_redelivery((2, "t", 2))  # 3 newer ones fill the Receive Maximum


def test_a_group_larger_than_the_receive_maximum_is_recognised_whole(tmp_path: Path) -> None:
    # Mosquitto 2.0.11 stops holding to the Receive Maximum after the first PUBACKs: one
    # read (one group) then brings thousands of messages. Logged, PUBACK not yet written,
    # kill -9: the broker re-sends all of them first, and every one is recognised.
    log = IntakeLog(tmp_path / "intake.log", horizon=3)
    log.recover(0)
    log.append([ROW_A], [(1, "t", 1)])
    big = [(mid, "t", mid) for mid in range(2, 12)]  # 10 messages, horizon 3
    log.append([ROW_B] * len(big), big)
    log.arm()
    assert [log.is_redelivery(e) for e in big] == [True] * len(big)
    assert not log.is_redelivery((12, "t", 12))  # new: counted
    log.arm()
    for _ in range(11):  # 11 = the kept groups' messages: then the look-up ends
        log.is_redelivery((99, "x", 99))
    assert not log.is_redelivery((11, "t", 11))


def test_compaction_keeps_unsealed_nothing_and_the_last_groups(tmp_path: Path) -> None:
    path = tmp_path / "intake.log"
    log = IntakeLog(path)
    log.recover(0)
    old = intake.COMPACT_BYTES
    intake.COMPACT_BYTES = 1
    try:
        log.append([ROW_A], [(1, "t", 1)])
        log.seal_begin(0)
        log.sealed()
    finally:
        intake.COMPACT_BYTES = old
    log.append([ROW_B], [(2, "t", 2)])
    again = IntakeLog(path)
    assert again.recover(next_seq=1) == [ROW_B]
    again.arm()
    assert again.is_redelivery((1, "t", 1))
