"""The close log's file: what a restore re-takes after each kind of crash (``close_log``)."""

from __future__ import annotations

import pytest

from shoal.errors import SchemaError
from shoal.processors.close_log import COMPACT_BYTES, CloseLog, Decision


class File:
    """The log's file, written as the runtime writes it."""

    def __init__(self) -> None:
        self.data = b""
        self.rewrites = 0

    def write(self, log: CloseLog) -> None:
        write = log.take()
        if write is not None:
            self.data = write.data if write.replace else self.data + write.data
            self.rewrites += write.replace


def close(threshold: int, **applied: int) -> Decision:
    return Decision("close", threshold, applied)


def test_a_restore_re_takes_the_closes_after_the_checkpoint_with_whole_vectors() -> None:
    log, file = CloseLog(), File()
    log.record(close(1_000, a=1))
    generation = log.mark({"a": 2, "b": 1})  # a snapshot: a=2, b=1
    log.record(close(2_000, a=3, b=1))
    log.record(close(3_000, a=3, b=2))
    file.write(log)
    # the checkpoint of `generation` never became durable: restore the older one (0)
    decisions = CloseLog().load(file.data, 0, {})
    assert [(d.threshold, dict(d.applied)) for d in decisions] == [
        (1_000, {"a": 1}),
        (2_000, {"a": 3, "b": 1}),
        (3_000, {"a": 3, "b": 2}),
    ]
    # it did, and the crash came before the log was rewritten: only what followed it
    decisions = CloseLog().load(file.data, generation, {"a": 2, "b": 1})
    assert [d.threshold for d in decisions] == [2_000, 3_000]
    assert dict(decisions[0].applied) == {"a": 3, "b": 1}


def test_a_durable_checkpoint_trims_the_log_to_what_follows_it() -> None:
    log, file = CloseLog(), File()
    log.record(close(1_000, a=1))
    generation = log.mark({"a": 1})
    log.record(close(2_000, a=2))
    file.write(log)
    log.settle(generation)
    file.write(log)
    decisions = CloseLog().load(file.data, generation, {"a": 1})
    assert [(d.threshold, dict(d.applied)) for d in decisions] == [(2_000, {"a": 2})]
    # a log older than the checkpoint with no mark of it has nothing for it
    assert CloseLog().load(file.data, generation + 1, {"a": 2}) == []


def test_checkpoints_rewrite_the_file_only_once_enough_is_stale() -> None:
    """Each durable checkpoint drops its entries from memory; the file is rewritten (two
    flushes to disk) only once the entries it holds before the last checkpoint reach
    ``COMPACT_BYTES``, and a restore after any checkpoint re-takes exactly what followed it."""
    log, file = CloseLog(), File()
    file.write(log)  # the header
    checkpoints = 0
    while file.rewrites < 3:
        checkpoints += 1
        log.record(close(checkpoints * 1_000, a=checkpoints, b=checkpoints // 2))
        applied = {"a": checkpoints + 1, "b": checkpoints // 2}
        generation = log.mark(applied)
        log.record(close(checkpoints * 1_000 + 500, a=checkpoints + 1, b=checkpoints // 2))
        file.write(log)  # the snapshot's mark and what follows, before it is taken
        log.settle(generation)  # the snapshot is durable
        file.write(log)
        decisions = CloseLog().load(file.data, generation, applied)
        assert [d.threshold for d in decisions] == [checkpoints * 1_000 + 500]
        assert len(file.data) < COMPACT_BYTES + 1_000
    assert file.rewrites == 3
    assert checkpoints > 100 * file.rewrites  # not one rewrite per checkpoint


def test_a_restored_log_holds_its_replay_until_the_next_checkpoint() -> None:
    log, file = CloseLog(), File()
    log.record(close(1_000, a=1))
    file.write(log)
    restored = CloseLog()
    decisions = restored.load(file.data, 0, {})
    file.write(restored)  # rewritten for the restored checkpoint
    again = CloseLog().load(file.data, 0, {})
    assert again == decisions
    restored.keep([], {})  # a replay given up before re-taking anything
    file.write(restored)
    assert CloseLog().load(file.data, 0, {}) == []


def test_a_torn_last_entry_is_left_out_and_garbage_is_refused() -> None:
    log, file = CloseLog(), File()
    log.record(close(1_000, a=1))
    log.record(close(2_000, a=2))
    file.write(log)
    torn = file.data[:-3]
    assert [d.threshold for d in CloseLog().load(torn, 0, {})] == [1_000]
    with pytest.raises(SchemaError) as caught:
        CloseLog().load(b"\x93\x01\x02\x03", 0, {})
    assert caught.value.reason == "bad_log"


def test_only_a_close_that_publishes_asks_for_a_flush_to_disk() -> None:
    log = CloseLog()
    first = log.take()
    assert first is not None
    assert first.replace  # the header
    log.record(close(1_000, a=1), sync=False)
    write = log.take()
    assert write is not None
    assert (write.replace, write.sync) == (False, False)
    log.record(close(2_000, a=2))
    write = log.take()
    assert write is not None
    assert write.sync
    assert log.take() is None
    disabled = CloseLog(enabled=False)
    disabled.record(close(1_000, a=1))
    assert disabled.take() is None
