"""Rendezvous ownership: every member computes the same owner; a change moves only what it must."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.control.assignment import Announcement, Owned, owned_by, owner
from shoal.errors import ControlError

PIPELINES = {f"p{i}": 1 + i % 3 for i in range(60)}
SLOTS = [(name, k) for name, count in PIPELINES.items() for k in range(count)]


def table(members: set[str]) -> dict[tuple[str, int], str | None]:
    return {slot: owner(members, *slot) for slot in SLOTS}


def test_every_member_computes_the_same_disjoint_and_complete_assignment() -> None:
    members = {"a", "b", "c"}
    shares = [owned_by(m, members, PIPELINES) for m in sorted(members)]
    assert sum(len(s) for s in shares) == len(SLOTS)
    assert set().union(*shares) == set(SLOTS)
    for me, share in zip(sorted(members), shares, strict=True):
        assert all(owner(members, *slot) == me for slot in share)
    assert all(shares), "60 pipelines spread over three members leave none idle"


def test_a_member_leaving_moves_only_its_own_partitions() -> None:
    before = table({"a", "b", "c"})
    after = table({"a", "b"})
    moved = {slot for slot in SLOTS if before[slot] != after[slot]}
    assert moved == {slot for slot in SLOTS if before[slot] == "c"}


def test_a_member_joining_takes_only_partitions_it_wins() -> None:
    before = table({"a", "b"})
    after = table({"a", "b", "c"})
    assert all(after[s] in (before[s], "c") for s in SLOTS)
    assert any(after[s] == "c" for s in SLOTS)


def test_no_members_no_owner_and_me_counts_as_live() -> None:
    assert owner([], "p", 0) is None
    assert owned_by("solo", [], {"p": 2}) == {("p", 0), ("p", 1)}


@given(st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=6), st.data())
def test_the_owner_does_not_depend_on_the_order_members_are_seen_in(
    members: set[str], data: st.DataObject
) -> None:
    order = data.draw(st.permutations(sorted(members)))
    assert owner(order, "pipe", 3) == owner(sorted(members), "pipe", 3)


def test_announcements_round_trip_and_refuse_what_is_not_one() -> None:
    a = Announcement("c1", 5, (Owned("temps", 1, 2, 3),))
    assert Announcement.from_json(a.to_json()) == a
    for bad in (b"{", b"[]", b'{"v": 1, "component": "worker", "id": "x", "at": 1, "owns": []}'):
        with pytest.raises(ControlError) as info:
            Announcement.from_json(bad)
        assert info.value.reason == "invalid_announcement"
