"""Assembling a window's partitions into one frame, and dropping re-published windows."""

from __future__ import annotations

from shoal.client import Deduplicator, WindowAssembler
from tests.unit.archive.conftest import T0, window_message


def test_single_partition_windows_pass_straight_through() -> None:
    assembler = WindowAssembler()
    [window] = assembler.add(window_message(), now_ms=0)
    assert window.complete
    assert window.partitions_seen == (0,)
    assert window.frame["key"].to_list() == ["a", "b"]
    assert assembler.add(window_message(), now_ms=1) == []  # a duplicate
    assert assembler.dedup.duplicates == 1


def test_partitions_are_joined_when_all_arrived() -> None:
    assembler = WindowAssembler()
    assert assembler.add(window_message(partition=1, partitions=2, keys=("c", "a")), 0) == []
    assert assembler.pending == 1
    [window] = assembler.add(window_message(partition=0, partitions=2, keys=("b",)), 5)
    assert window.complete
    assert window.partitions_seen == (0, 1)
    assert window.frame["key"].to_list() == ["a", "b", "c"]
    assert window.frame["partition"].to_list() == [1, 0, 1]
    assert assembler.pending == 0


def test_a_partition_without_keys_is_known_from_its_close_threshold() -> None:
    assembler = WindowAssembler()
    first = window_message(partition=0, partitions=3, watermark=T0 + 10_000)
    assert assembler.add(first, 0) == []
    # partition 1 emitted a later window: it has closed past ours with nothing for it
    later = window_message(partition=1, partitions=3, start=T0 + 10_000, watermark=T0 + 20_000)
    assert assembler.add(later, 1) == []
    # partition 2 reports its progress in a heartbeat, which counts once it is settled
    assert assembler.note_progress("p", 2, T0 + 20_000, 2) == []
    ready = assembler.expire(2 + assembler.settle_ms)
    assert [(w.start, w.partitions_seen, w.complete) for w in ready] == [(T0, (0,), True)]
    # the later window still waits for partition 0 (partition 2 has closed past it)
    assert assembler.pending == 1
    assert assembler.note_progress("p", 0, T0 + 19_999, 3_000) == []
    assert assembler.expire(4_000) == []
    assert assembler.note_progress("p", 0, T0 + 20_000, 4_000) == []
    [window] = assembler.expire(5_000)
    assert window.start == T0 + 10_000
    assert window.complete
    assert window.partitions_seen == (1,)


def test_a_burst_of_windows_waits_for_every_partition() -> None:
    # A flush closes several windows in one step: every message carries the same (final)
    # watermark, but a partition's later windows are still on their way.
    assembler = WindowAssembler()
    final = T0 + 30_000
    assert assembler.add(window_message(partition=0, partitions=2, watermark=final), 0) == []
    [w1] = assembler.add(window_message(partition=1, partitions=2, watermark=final), 1)
    assert w1.start == T0
    assert w1.partitions_seen == (0, 1)
    w2_p1 = window_message(partition=1, partitions=2, start=T0 + 10_000, watermark=final)
    assert assembler.add(w2_p1, 2) == []  # partition 0's window 2 is still on its way
    w2_p0 = window_message(partition=0, partitions=2, start=T0 + 10_000, watermark=final)
    [w2] = assembler.add(w2_p0, 3)
    assert w2.partitions_seen == (0, 1)


def test_incomplete_windows_are_released_after_the_wait() -> None:
    assembler = WindowAssembler(max_wait_ms=1_000)
    assembler.add(window_message(partition=0, partitions=2), now_ms=0)
    assert assembler.expire(999) == []
    [window] = assembler.expire(1_000)
    assert not window.complete
    assert window.partitions_seen == (0,)
    assembler.add(window_message(partition=0, partitions=2, start=T0 + 10_000), now_ms=0)
    [flushed] = assembler.flush()
    assert flushed.start == T0 + 10_000
    assert not flushed.complete


def test_revisions_are_separate_windows() -> None:
    assembler = WindowAssembler()
    assert len(assembler.add(window_message(revision=1), 0)) == 1
    assert len(assembler.add(window_message(revision=2), 0)) == 1


def test_dedup_memory_is_bounded() -> None:
    dedup = Deduplicator(capacity=2)
    assert dedup.first_time(("p", "w", 1, 0, 1))
    assert dedup.first_time(("p", "w", 2, 0, 1))
    assert not dedup.first_time(("p", "w", 1, 0, 1))  # refreshed
    assert dedup.first_time(("p", "w", 3, 0, 1))  # evicts 2
    assert dedup.first_time(("p", "w", 2, 0, 1))
    assert dedup.duplicates == 1


def test_a_correction_replaces_its_partition_and_releases_the_window_again() -> None:
    assembler = WindowAssembler()
    assembler.add(window_message(partition=0, partitions=2, keys=("a",)), 0)
    [first] = assembler.add(window_message(partition=1, partitions=2, keys=("b",)), 1)
    assert first.revision == 1
    # partition 1 folds late rows into the window: only its message comes again
    correction = window_message(partition=1, partitions=2, keys=("b", "c"), revision=2)
    [revised] = assembler.add(correction, 2)
    assert revised.revision == 2
    assert revised.complete
    assert revised.partitions_seen == (0, 1)
    assert revised.frame["key"].to_list() == ["a", "b", "c"]
    # a stale copy of partition 1 (revision 1, re-published after a restart) changes nothing
    assert assembler.add(window_message(partition=1, partitions=2, keys=("b",)), 3) == []


def test_a_single_partition_correction_passes_and_a_stale_copy_does_not() -> None:
    assembler = WindowAssembler()
    assert len(assembler.add(window_message(revision=2, keys=("a", "b", "c")), 0)) == 1
    assert assembler.add(window_message(revision=1), 1) == []  # older: dropped
    [latest] = assembler.add(window_message(revision=3, keys=("a", "b", "c", "d")), 2)
    assert latest.revision == 3


def test_a_recount_with_the_same_revision_and_more_rows_is_a_later_copy_not_a_duplicate() -> None:
    # A combiner that restarts while folding in an idle gateway's rows can close a window
    # again with the same revision and more rows: consumers must take it, and drop exact
    # duplicates of it.
    for partitions in (1, 2):
        assembler = WindowAssembler()
        first = window_message(revision=2, partitions=partitions, keys=("a", "b"))
        recount = window_message(revision=2, partitions=partitions, keys=("a", "b", "c"))
        assembler.add(first, 0)
        if partitions == 2:
            assembler.add(window_message(partition=1, partitions=2, revision=2, keys=("z",)), 0)
        [later] = assembler.add(recount, 1)
        assert later.frame["key"].to_list()[:3] == ["a", "b", "c"]
        assert assembler.add(recount, 2) == []  # the same copy again: a duplicate
        assert assembler.dedup.duplicates == 1
