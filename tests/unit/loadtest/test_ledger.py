"""The chaos ledger counts each window message and late report once, by identity."""

from __future__ import annotations

import msgpack
import orjson

from shoal.broker.session import Message
from shoal.loadtest._ledger import Ledger
from shoal.schemas.topics import Topics

T = Topics(root="r")


def window(
    start: int, partition: int, rows: int, window: str = "tumbling-2s", revision: int = 1
) -> Message:
    body = {
        "window": window,
        "start": start,
        "partition": partition,
        "revision": revision,
        "rows": rows,
    }
    return Message(T.results("p"), orjson.dumps(body))


def late(
    partition: int, gateway: str, seq: int, rows: int, windows: tuple[str, ...] = ("tumbling-2s",)
) -> Message:
    """A late report of ``rows`` measurements, late for each of ``windows``."""
    body = {
        "partition": partition,
        "gateway_id": gateway,
        "seq": seq,
        "rows": rows * len(windows),
        "late": [{"window": w, "rows": rows} for w in windows],
    }
    return Message(T.late("p"), orjson.dumps(body))


def test_duplicates_count_once_and_conflicts_are_flagged() -> None:
    ledger = Ledger("p", "tumbling-2s")
    for message in (
        window(0, 0, 10),
        window(0, 1, 5),
        window(0, 0, 10),  # re-published after a combiner restart: same identity, same rows
        window(2000, 0, 7),
        window(0, 0, 7, window="hopping-4s-2s"),  # another window spec: not counted
        late(0, "gw", 3, 2),
        late(0, "gw", 3, 2),
        late(1, "gw", 3, 1),
        # late for its tumbling window and two hopping ones: still 4 measurements
        late(1, "gw", 4, 4, windows=("tumbling-2s", "hopping-4s-2s", "hopping-4s-2s")),
    ):
        ledger.take(T, message)
    assert ledger.rows_in_results == 22
    assert ledger.late_rows == 7
    assert ledger.republished == 1
    assert ledger.conflicts == 0
    ledger.take(T, window(2000, 0, 8))
    assert ledger.conflicts == 1
    assert ledger.conflict_rows == 1


def test_a_correction_replaces_its_windows_rows() -> None:
    ledger = Ledger("p", "tumbling-2s")
    for message in (
        window(0, 0, 10),
        window(0, 0, 13, revision=3),  # the whole window again, with late rows folded in
        window(0, 0, 12, revision=2),  # an older correction arriving after the newer one
        window(0, 1, 5),
        window(0, 1, 5),
    ):
        ledger.take(T, message)
    assert ledger.rows_in_results == 18
    assert ledger.corrections == 2
    assert ledger.republished == 1
    assert ledger.conflicts == 0


def test_dead_letters_and_unreadable_messages() -> None:
    ledger = Ledger("p")
    record = msgpack.packb({"error": {"reason": "not_finite"}, "payload": b"x"})
    ledger.take(T, Message(T.deadletter("p"), record))
    ledger.take(T, Message(T.deadletter("p"), b"\xc1"))
    ledger.take(T, Message(T.results("p"), b"{"))
    assert ledger.deadletters == 1
    assert ledger.reasons == {"not_finite": 1}
    assert ledger.unreadable == 2
    assert ledger.window is None


def window_part(
    start: int, rows: int, part: int, parts: int, revision: int = 1, partition: int = 0
) -> Message:
    body = {
        "window": "tumbling-2s",
        "start": start,
        "partition": partition,
        "revision": revision,
        "rows": rows,
        "part": part,
        "parts": parts,
    }
    return Message(T.results("p"), orjson.dumps(body))


def test_parts_of_a_window_add_up_and_copies_count_once() -> None:
    ledger = Ledger("p")
    for message in (window_part(0, 10, 0, 3), window_part(0, 12, 2, 3), window_part(0, 10, 0, 3)):
        ledger.take(T, message)
    assert ledger.rows_in_results == 22
    assert ledger.republished == 1
    assert ledger.conflicts == 0
    assert ledger.missing_parts == 1
    ledger.take(T, window_part(0, 5, 1, 3))
    assert ledger.rows_in_results == 27
    assert ledger.missing_parts == 0


def test_a_correction_in_other_parts_replaces_every_part_of_the_older_revision() -> None:
    ledger = Ledger("p")
    for message in (window_part(0, 10, 0, 2), window_part(0, 10, 1, 2)):
        ledger.take(T, message)
    assert ledger.rows_in_results == 20
    for index, rows in enumerate((7, 7, 7)):
        ledger.take(T, window_part(0, rows, index, 3, revision=2))
    assert ledger.rows_in_results == 21
    assert ledger.missing_parts == 0
    assert ledger.corrections == 3
