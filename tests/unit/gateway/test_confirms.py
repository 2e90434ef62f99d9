"""Confirmation bookkeeping across partitions and pipelines."""

from __future__ import annotations

from shoal.gateway._confirms import ConfirmTracker
from shoal.schemas.control import Confirm


def c(pipeline: str, partition: int, partitions: int, seq: int, at: int = 1) -> Confirm:
    return Confirm("gw", pipeline, partition, partitions, seq, at)


def test_a_pipeline_confirms_when_every_partition_has() -> None:
    tracker = ConfirmTracker("gw")
    assert tracker.confirmed_seq() == -1
    tracker.update(c("p", 0, 3, 10))
    tracker.update(c("p", 2, 3, 12))
    assert tracker.confirmed_seq() == -1  # partition 1 has said nothing
    tracker.update(c("p", 1, 3, 7))
    assert tracker.confirmed_seq() == 7
    tracker.update(c("p", 1, 3, 11))
    assert tracker.confirmed_seq() == 10


def test_without_confirm_from_any_one_pipeline_suffices() -> None:
    tracker = ConfirmTracker("gw")
    tracker.update(c("slow", 0, 1, 3))
    tracker.update(c("fast", 0, 2, 9))
    tracker.update(c("fast", 1, 2, 8))
    assert tracker.confirmed_seq() == 8


def test_confirm_from_needs_every_named_pipeline_and_ignores_others() -> None:
    tracker = ConfirmTracker("gw", ("a", "b"))
    tracker.update(c("a", 0, 1, 9))
    tracker.update(c("other", 0, 1, 100))
    assert tracker.confirmed_seq() == -1
    tracker.update(c("b", 0, 1, 4))
    assert tracker.confirmed_seq() == 4
    assert tracker.pipeline_seq("other") == -1


def test_confirmations_never_go_back_and_other_gateways_are_ignored() -> None:
    tracker = ConfirmTracker("gw")
    assert tracker.update(c("p", 0, 1, 5))
    assert not tracker.update(c("p", 0, 1, 3))  # a combiner restored from an old checkpoint
    assert tracker.confirmed_seq() == 5
    assert not tracker.update(Confirm("other-gw", "p", 0, 1, 50, 1))
    assert tracker.confirmed_seq() == 5


def test_the_newest_message_sets_the_partition_count() -> None:
    tracker = ConfirmTracker("gw")
    # The pipeline shrank from 4 to 2 partitions; stale retained confirms of 4 remain.
    tracker.update(c("p", 0, 2, 20, at=200))
    tracker.update(c("p", 3, 4, 5, at=100))
    tracker.update(c("p", 1, 2, 18, at=201))
    assert tracker.confirmed_seq() == 18


def test_missing_seqs_are_the_union_of_the_partitions_latest_reports() -> None:
    tracker = ConfirmTracker("gw")
    assert tracker.update(Confirm("gw", "p", 0, 2, 4, 1, (6, 8)))
    assert tracker.update(Confirm("gw", "p", 1, 2, 4, 1, (7,)))
    assert tracker.missing() == {6, 7, 8}
    # A new report replaces the partition's old one; the change alone wakes the gateway.
    assert tracker.update(Confirm("gw", "p", 0, 2, 4, 2, ()))
    assert tracker.missing() == {7}
    assert not tracker.update(Confirm("gw", "p", 1, 2, 4, 3, (7,)))


def test_missing_seqs_at_or_below_the_confirmed_seq_are_dropped() -> None:
    tracker = ConfirmTracker("gw")
    tracker.update(Confirm("gw", "p", 0, 2, 10, 1, (12,)))
    tracker.update(Confirm("gw", "p", 1, 2, 5, 1, (7, 9)))
    assert tracker.confirmed_seq() == 5
    assert tracker.missing() == {7, 9, 12}
    tracker.update(Confirm("gw", "p", 1, 2, 11, 2))
    assert tracker.missing() == {12}


def test_missing_seqs_of_pipelines_that_do_not_count_are_ignored() -> None:
    tracker = ConfirmTracker("gw", ("a",))
    tracker.update(Confirm("gw", "other", 0, 1, 0, 1, (3,)))
    tracker.update(Confirm("gw", "a", 0, 1, 0, 1, (2,)))
    assert tracker.missing() == {2}
