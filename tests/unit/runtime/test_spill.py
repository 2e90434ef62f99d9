"""The reorder buffer's files (``runtime._spill``): kept, read back, removed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from shoal.processors.combine import Combiner
from shoal.runtime._spill import PREFIX, DirectorySpill, partial_spill
from tests.unit.processors.test_combiner import Harness, make_spec


def spill_in(folder: Path, max_bytes: int = 1_000) -> DirectorySpill[str]:
    return DirectorySpill(str.encode, bytes.decode, max_bytes=max_bytes, parent=folder)


def test_items_come_back_as_they_were_and_their_files_go(tmp_path: Path) -> None:
    spill = spill_in(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no folder until something is spilled
    spill.put(("gw/a b", 7), "seven")  # any gateway id is a valid file name
    spill.put(("gw/a b", 8), "eight!")
    assert spill.bytes == 11
    assert spill.room(989)
    assert not spill.room(990)
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert spill.take(("gw/a b", 8)) == "eight!"
    spill.discard(("gw/a b", 7))
    assert (spill.bytes, list(folder.iterdir())) == (0, [])
    spill.close()
    assert not folder.exists()


def test_a_spill_nobody_closed_is_removed_when_collected(tmp_path: Path) -> None:
    spill = spill_in(tmp_path)
    spill.put(("g", 1), "x")
    del spill
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_folders_of_processes_that_died_are_removed_by_the_next_spill(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    orphan = tmp_path / f"{PREFIX}{int(dead.stdout)}-abc"
    orphan.mkdir()
    (orphan / "67-1").write_bytes(b"left behind by kill -9")
    alive = tmp_path / f"{PREFIX}{os.getppid()}-def"  # a running process's: kept
    alive.mkdir()
    spill = spill_in(tmp_path)
    spill.put(("g", 1), "x")
    assert not orphan.exists()
    assert alive.exists()
    spill.close()


def _closed_after_a_slow_first_batch(max_pending_bytes: int | None) -> tuple[list[object], int]:
    """gw's batch 0 arrives after 1..5 (a busy worker held it); what closes, and spills."""
    h = Harness(make_spec())
    h.combiner = Combiner(
        h.spec, 0, h.clock, max_pending_bytes=max_pending_bytes, spill=partial_spill
    )
    h.announce("gw")
    early = [
        h.partial("gw", seq, [("k", 5_000 + 300 * seq, float(seq)), ("j", 5_100, 2.5)])
        for seq in range(1, 6)
    ]
    for partial in early:
        assert h.combiner.receive(partial).applied == 0
    spilled = h.combiner.tracker.spilled
    h.send("gw", 0, [("k", 5_050, -1.0)])
    h.send("gw", 6, [("k", 9_000, 0.0)])
    closed = h.combiner.tick().closed
    assert closed is not None
    assert h.combiner.tracker.gateways["gw"].deferred == 0
    return closed.frame.sort("start", "key").rows(), spilled


def test_a_combiner_applies_spilled_partials_as_it_applies_those_kept_in_memory() -> None:
    held, none_spilled = _closed_after_a_slow_first_batch(None)
    spilled, count = _closed_after_a_slow_first_batch(1)  # memory for none: all to files
    assert none_spilled == 0
    assert count == 5
    assert spilled == held


def test_a_run_that_waited_in_files_is_read_back_a_piece_at_a_time() -> None:
    # Five early partials all in files (memory for none): when the slow batch comes, one
    # receive applies all six, each spilled one read back only after the one before it was
    # applied, never the whole run at once.
    h = Harness(make_spec())
    h.combiner = combiner = Combiner(h.spec, 0, h.clock, max_pending_bytes=1, spill=partial_spill)
    h.announce("gw")
    for seq in range(1, 6):
        h.send("gw", seq, [("k", 5_000 + 300 * seq, float(seq))])
    assert combiner.tracker.spilled == 5
    events: list[str] = []
    spill = combiner.tracker.spill
    assert spill is not None
    take, apply_into = spill.take, combiner._apply_into
    spill.take = lambda key: (events.append("read"), take(key))[1]  # type: ignore[method-assign]
    combiner._apply_into = lambda *a: (events.append("apply"), apply_into(*a))[1]  # type: ignore[method-assign]
    assert h.send("gw", 0, [("k", 5_050, -1.0)]).applied == 6
    # The first piece: batch 0 and the first spilled one (read back: the bound is reached).
    assert events == ["read", "apply", "apply"] + ["read", "apply"] * 4
