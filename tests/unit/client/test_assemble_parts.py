"""A window split into parts (too large for one broker packet) is assembled whole, once."""

from __future__ import annotations

from dataclasses import replace

from shoal.client import WindowAssembler
from shoal.schemas.results import WindowMessage
from tests.unit.archive.conftest import window_message


def part(
    index: int, parts: int, keys: tuple[str, ...], *, revision: int = 1, **kw: int
) -> WindowMessage:
    return replace(window_message(keys=keys, revision=revision, **kw), part=index, parts=parts)


def test_a_single_partition_window_waits_for_every_part() -> None:
    assembler = WindowAssembler()
    assert assembler.add(part(1, 2, ("c", "d")), now_ms=0) == []
    assert assembler.pending == 1
    [window] = assembler.add(part(0, 2, ("a", "b")), now_ms=1)
    assert window.complete
    assert window.frame["key"].to_list() == ["a", "b", "c", "d"]
    assert window.partitions_seen == (0,)
    # a copy of a part (re-published after a restart) is dropped
    assert assembler.add(part(1, 2, ("c", "d")), now_ms=2) == []
    assert assembler.dedup.duplicates == 1


def test_copies_of_parts_differ_only_by_part_in_their_identity() -> None:
    a, b = part(0, 2, ("a",)), part(1, 2, ("b",))
    assert a.identity[:5] == b.identity[:5]
    assert a.identity != b.identity
    assert a.copy_key != b.copy_key


def test_a_correction_with_another_part_count_supersedes_the_whole_window() -> None:
    assembler = WindowAssembler()
    assembler.add(part(0, 2, ("a", "b")), 0)
    [first] = assembler.add(part(1, 2, ("c", "d")), 1)
    assert first.revision == 1
    # revision 2 comes in 3 parts: nothing until all arrived, never a mix of revisions
    assert assembler.add(part(0, 3, ("a", "b"), revision=2), 2) == []
    assert assembler.add(part(2, 3, ("e",), revision=2), 3) == []
    # a late copy of revision 1 changes nothing
    assert assembler.add(part(1, 2, ("c", "x"), revision=1), 4) == []
    [second] = assembler.add(part(1, 3, ("c", "d"), revision=2), 5)
    assert second.revision == 2
    assert second.frame["key"].to_list() == ["a", "b", "c", "d", "e"]
    assert second.frame["revision"].unique().to_list() == [2]


def test_partitions_and_parts_together() -> None:
    assembler = WindowAssembler()
    assert assembler.add(part(0, 2, ("a",), partition=0, partitions=2), 0) == []
    assert assembler.add(window_message(keys=("z",), partition=1, partitions=2), 1) == []
    [window] = assembler.add(part(1, 2, ("b",), partition=0, partitions=2), 2)
    assert window.complete
    assert window.partitions_seen == (0, 1)
    assert window.frame["key"].to_list() == ["a", "b", "z"]


def test_a_window_missing_a_part_is_released_incomplete_after_the_wait() -> None:
    assembler = WindowAssembler(max_wait_ms=100)
    assert assembler.add(part(0, 3, ("a",)), 0) == []
    assert assembler.add(part(2, 3, ("c",)), 1) == []
    [window] = assembler.expire(100)
    assert not window.complete
    assert window.frame["key"].to_list() == ["a", "c"]


def test_a_stale_copy_of_an_older_revision_is_not_delivered_after_a_newer_one() -> None:
    assembler = WindowAssembler(max_wait_ms=100)
    assembler.add(part(0, 2, ("a",), revision=2), 0)
    [window] = assembler.add(part(1, 2, ("b",), revision=2), 1)
    assert window.revision == 2
    # revision 1, whole or in parts, re-published after a restart: superseded
    assert assembler.add(window_message(keys=("a", "b")), 2) == []
    assert assembler.add(part(0, 2, ("a",)), 3) == []
    assert assembler.expire(1_000) == []
    # a later revision that fits one message is delivered
    [third] = assembler.add(window_message(keys=("a", "b"), revision=3), 4)
    assert third.revision == 3
