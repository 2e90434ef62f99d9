"""Sliding windows in the combiner core: the trigger, corrections that trigger, checkpoints.

A sliding window ``[end - size, end)`` is a result for a key only if the key has a row in its
last step ``[end - step, end)`` (docs/architecture.md, "Window kinds"; the arithmetic's own
table is in ``test_windows.py``, the oracle runs in ``test_exactness_in_memory.py``).
"""

from __future__ import annotations

import msgpack
import polars as pl

from shoal.processors.combine import Combiner
from shoal.processors.partials import spec_fingerprint
from tests.unit.processors.test_combiner import Harness, make_spec

WINDOW = {"kind": "sliding", "size_ms": 2_000, "step_ms": 1_000}
SPEC = make_spec(windows=[WINDOW], allowed_lateness_ms=3_000)


def rows_of(frame: pl.DataFrame) -> list[tuple[int, str, int]]:
    return frame.select("start", "key", "count").sort("start", "key").rows()


def closed_two_windows(h: Harness) -> pl.DataFrame:
    """k's rows trigger [4000, 6000) but not [5000, 7000); j's trigger both."""
    h.announce("gw")
    h.send("gw", 0, [("k", 5_100, 1.0), ("j", 5_900, 10.0)])
    h.send("gw", 1, [("j", 6_200, 20.0), ("x", 7_600, 0.0)])  # threshold 7_100
    step = h.combiner.tick()
    assert step.closed is not None
    assert step.closed.revisions == {}
    return step.closed.frame


def test_a_window_is_emitted_only_for_keys_with_a_row_in_its_last_step() -> None:
    h = Harness(SPEC)
    frame = closed_two_windows(h)
    assert rows_of(frame) == [(4_000, "j", 1), (4_000, "k", 1), (5_000, "j", 2)]
    assert frame["window"].unique().to_list() == ["sliding-2s-1s"]
    # k's row still counts where it triggers nothing: it is in the state, not late
    assert h.combiner.counters.rows_late == 0


def test_a_late_trigger_row_publishes_the_key_as_a_correction() -> None:
    """k first appears in [5000, 7000) with revision 2: the window's results changed."""
    h = Harness(SPEC)
    closed_two_windows(h)
    step = h.send("gw", 2, [("k", 6_500, 4.0)])  # behind by the lateness, within the allowance
    assert step.late == []
    revised = h.combiner.close_ready(h.clock.now_ms())
    assert revised is not None
    assert revised.revisions == {("sliding-2s-1s", 5_000): 2}
    assert rows_of(revised.frame) == [(5_000, "j", 2), (5_000, "k", 2)]
    assert h.combiner.counters.corrections_emitted == 1


def test_the_trigger_survives_a_checkpoint() -> None:
    """A restored combiner keeps each state's latest event time, so it triggers the same."""
    h = Harness(SPEC)
    h.announce("gw")
    h.send("gw", 0, [("k", 5_100, 1.0), ("j", 5_900, 10.0)])
    restored = Combiner(SPEC, 0, h.clock)
    restored.restore(h.combiner.snapshot())
    h.combiner = restored
    h.send("gw", 1, [("j", 6_200, 20.0), ("x", 7_600, 0.0)])
    step = h.combiner.tick()
    assert step.closed is not None
    assert rows_of(step.closed.frame) == [(4_000, "j", 1), (4_000, "k", 1), (5_000, "j", 2)]


def test_without_allowed_lateness_the_prepared_close_triggers_the_same() -> None:
    spec = make_spec(windows=[WINDOW])
    h = Harness(spec)
    h.announce("gw")
    h.send("gw", 0, [("k", 5_100, 1.0), ("j", 5_900, 10.0)])
    h.send("gw", 1, [("j", 6_200, 20.0), ("x", 7_400, 0.0)])  # threshold 6_900: prepares 7_000
    h.combiner.tick()
    h.send("gw", 2, [("x", 7_600, 0.0)])  # threshold 7_100
    step = h.combiner.tick()
    assert step.closed is not None
    assert rows_of(step.closed.frame) == [(5_000, "j", 2)]


def test_the_fingerprint_tells_a_sliding_window_from_a_hopping_one() -> None:
    sliding = make_spec(windows=[{**WINDOW, "name": "w"}])
    hopping = make_spec(
        windows=[{"kind": "hopping", "size_ms": 2_000, "slide_ms": 1_000, "name": "w"}]
    )
    assert spec_fingerprint(sliding) != spec_fingerprint(hopping)


# -- panes in the combiner ------------------------------------------------------------------
#
# Partials of a sliding window carry state per (pane of step_ms, key); the combiner keeps
# panes and assembles a window from them when it closes, unless a batch is late for some of
# its windows or leaves a gap of 2 to fan - 1 panes for a key, which it expands into window
# rows first. Whatever the path, every (window, key) must equal what a hopping window of the
# same size and slide computes over the same batches (the worker's fan-out, the path sliding
# windows took before), restricted to the keys the trigger emits.

PANED = {"kind": "sliding", "size_ms": 4_000, "step_ms": 1_000, "name": "w"}
HOPPING = {"kind": "hopping", "size_ms": 4_000, "slide_ms": 1_000, "name": "w"}
COLUMNS = ["window", "start", "end", "key", "rows", "batches", "count", "sum", "min", "max", "p50"]


def lockstep(
    batches: list[list[tuple[str, int, float]]], **changes: object
) -> tuple[Harness, Harness, pl.DataFrame, pl.DataFrame]:
    """The same batches (seq order, one gateway) into a sliding and a hopping combiner;
    everything closed (flushed at the end), as frames sorted by window start and key."""
    paned, hopping = (
        Harness(make_spec(windows=[window], **changes)) for window in (PANED, HOPPING)
    )
    for h in (paned, hopping):
        h.announce("gw")
        for seq, rows in enumerate(batches):
            h.send("gw", seq, rows)
            closed = h.combiner.tick().closed  # corrections may close at the same threshold
            if closed is not None and closed.frame.height:
                h.emitted.append(closed.frame)
    frames = []
    for h in (paned, hopping):
        flushed = h.combiner.flush().frame
        frames.append(pl.concat([*h.emitted, flushed]).select(COLUMNS).sort("start", "key"))
    return paned, hopping, frames[0], frames[1]


def assert_within_hopping(sliding: pl.DataFrame, hopping: pl.DataFrame) -> None:
    """Every sliding result equals the hopping result of its (window start, key)."""
    assert sliding.height > 0
    joined = sliding.join(hopping, on=["start", "key"], how="left", suffix="_h")
    for column in COLUMNS:
        if column not in ("start", "key"):
            assert joined[column].to_list() == joined[f"{column}_h"].to_list(), column


def test_on_time_batches_are_kept_as_panes_and_equal_hopping_windows() -> None:
    # seq 1 spans panes 2..3 for k (consecutive: one run, counted once per window)
    batches = [
        [("k", 1_100, 1.0), ("j", 1_900, 2.0)],
        [("k", 2_500, 3.0), ("k", 3_200, 4.0), ("j", 3_900, 5.0)],
        [("k", 4_100, 6.0), ("j", 5_000, 7.0)],
        [("k", 9_000, 8.0)],
    ]
    paned, _, sliding, hopping = lockstep(batches)
    assert_within_hopping(sliding, hopping)
    window = sliding.filter((pl.col("start") == 0) & (pl.col("key") == "k"))
    assert window.select("rows", "batches").rows() == [(3, 2)]
    assert paned.combiner.counters.rows_late == 0


def test_panes_hold_state_once_per_pane_not_per_window() -> None:
    h = Harness(make_spec(windows=[PANED]))
    h.announce("gw")
    h.send("gw", 0, [("k", 1_100, 1.0), ("k", 2_500, 3.0), ("j", 2_600, 2.0)])
    state = h.combiner.state
    assert state.panes is not None
    assert state.rows == state.panes.rows  # nothing per window
    state.compact()
    assert state.panes.rows == 3 + 3  # three (pane, key) rows and their sketch cells
    assert h.combiner.counters.rows_applied == 3 * 4  # memberships, as for hopping windows


def test_a_key_with_a_gap_between_panes_is_expanded_into_windows() -> None:
    # k in panes 1 and 3 of one batch (2 apart, within one window of 4): expanded
    batches = [
        [("k", 1_100, 1.0), ("k", 3_200, 4.0), ("j", 3_900, 5.0)],
        [("k", 4_100, 6.0), ("j", 5_000, 7.0)],
        [("k", 9_000, 8.0)],
    ]
    h = Harness(make_spec(windows=[PANED]))
    h.announce("gw")
    h.send("gw", 0, batches[0])
    state = h.combiner.state
    assert state.panes is not None
    assert state.rows > state.panes.rows == 0  # window rows, no pane rows
    _, _, sliding, hopping = lockstep(batches)
    assert_within_hopping(sliding, hopping)
    both = sliding.filter((pl.col("start") == 0) & (pl.col("key") == "k"))
    assert both.select("rows", "batches").rows() == [(2, 1)]


def test_a_batch_late_for_its_oldest_windows_only_is_expanded() -> None:
    """Rows at 1_500 after the gateway reached 3_200: late for [-2000, 2000) only."""
    batches = [
        [("k", 1_100, 1.0), ("j", 3_200, 2.0)],
        [("k", 1_500, 3.0), ("j", 3_300, 4.0)],
        [("k", 2_500, 5.0), ("j", 4_000, 6.0)],
        [("k", 9_000, 8.0)],
    ]
    paned, hopping_h, sliding, hopping = lockstep(batches)
    assert_within_hopping(sliding, hopping)
    late = paned.combiner.counters.rows_late
    assert late == hopping_h.combiner.counters.rows_late == 1  # one membership: one window
    assert sorted(r["start"] for x in paned.late for r in x.frame.iter_rows(named=True)) == [-2_000]


def test_late_rows_within_the_allowance_correct_paned_windows() -> None:
    batches = [
        [("k", 1_100, 1.0), ("j", 3_200, 2.0)],
        [("j", 6_000, 4.0)],  # threshold 5_500: [1000, 5000) and earlier close
        [("k", 4_500, 3.0)],  # behind by the lateness: corrections, expanded
        [("k", 12_000, 8.0)],
    ]
    paned, _, sliding, hopping = lockstep(batches, allowed_lateness_ms=5_000)
    latest = sliding.unique(["start", "key"], keep="last", maintain_order=True)
    latest_h = hopping.unique(["start", "key"], keep="last", maintain_order=True)
    assert_within_hopping(latest, latest_h)
    assert paned.combiner.counters.corrections_emitted > 0


def test_panes_survive_a_checkpoint() -> None:
    batches = [
        [("k", 1_100, 1.0), ("j", 1_900, 2.0)],
        [("k", 2_500, 3.0), ("k", 3_200, 4.0), ("j", 3_900, 5.0)],
    ]
    h = Harness(make_spec(windows=[PANED]))
    h.announce("gw")
    for seq, rows in enumerate(batches):
        h.send("gw", seq, rows)
    h.send("gw", 2, [("j", 5_700, 7.0)])  # threshold 5_200: closes [1000, 5000) and before
    h.tick()
    restored = Combiner(h.spec, 0, h.clock)
    restored.restore(h.combiner.snapshot())
    h.combiner = restored
    h.send("gw", 3, [("k", 9_000, 8.0)])
    h.tick()
    h.emitted.append(h.combiner.flush().frame)
    sliding = pl.concat(h.emitted).select(COLUMNS).sort("start", "key")
    _, _, whole, hopping = lockstep([*batches, [("j", 5_700, 7.0)], [("k", 9_000, 8.0)]])
    assert sliding.equals(whole)  # each window once, none lost or repeated by the restore
    assert_within_hopping(sliding, hopping)


def test_a_snapshot_in_parts_is_the_snapshot_msgpack_packs() -> None:
    """``snapshot_parts`` joined is what ``msgpack.packb`` makes of the snapshot's content.

    The pane blobs and packed key names go into the checkpoint file as held, behind a bin
    header written by hand: the file must stay byte for byte the one ``packb`` wrote, which
    every restore reads.
    """
    h = Harness(make_spec(windows=[PANED]))
    h.announce("gw")
    h.send("gw", 0, [("k", 1_100, 1.0), ("j", 1_900, 2.0), ("k", 2_500, 3.0)])
    h.send("gw", 1, [("m", 3_200, 4.0), ("j", 3_900, 5.0)])
    for _ in range(2):  # the second: panes kept as packed by the first
        parts = h.combiner.snapshot_parts()
        joined = b"".join(parts)
        content = msgpack.unpackb(joined, raw=False)
        assert content["pane_chunks"]["panes"], "panes held: the hand-packed path ran"
        assert joined == msgpack.packb(content, use_bin_type=True)
    h.send("gw", 2, [("k", 3_300, 6.0)])  # a pane packed again
    joined = b"".join(h.combiner.snapshot_parts())
    assert joined == msgpack.packb(msgpack.unpackb(joined, raw=False), use_bin_type=True)


def test_a_combiner_restored_from_an_incremental_checkpoint_equals_one_never_stopped() -> None:
    """Panes are packed again only when they took rows since the last snapshot.

    Snapshots are taken after every batch; the second gateway lags, so panes packed by an
    earlier snapshot take rows afterwards (they must be packed again, or the restore loses
    them), and others are kept as packed. Whichever snapshot the combiner restarts from,
    with the rest of the batches sent again, the results equal a run that never stopped,
    exactly.
    """
    gw1 = [
        [("k", 1_100, 1.0), ("j", 1_900, 2.0)],
        [("k", 2_500, 3.0), ("j", 3_900, 5.0)],
        [("k", 4_100, 6.0), ("j", 4_200, 7.0)],
        [("k", 5_300, 8.0), ("j", 5_900, 9.0)],
        [("k", 9_000, 8.0), ("j", 9_500, 1.0)],
    ]
    gw2 = [
        [("k", 1_300, 10.0), ("m", 1_400, 4.0)],
        [("m", 2_100, 5.0), ("k", 2_900, 1.5)],
        [("m", 3_500, 2.5), ("k", 3_600, 0.5)],
        [("m", 4_900, 1.0), ("k", 4_950, 2.0)],
        [("k", 9_100, 3.0), ("m", 9_200, 3.0)],
    ]
    sends = [
        (g, seq, rows) for seq in range(5) for g, rows in (("gw1", gw1[seq]), ("gw2", gw2[seq]))
    ]

    def run(restart_after: int | None) -> pl.DataFrame:
        h = Harness(make_spec(windows=[PANED]))
        h.announce("gw1")
        h.announce("gw2")
        snapshots = []
        for i, (gateway, seq, rows) in enumerate(sends):
            h.send(gateway, seq, rows)
            h.tick()
            snapshots.append((i, h.combiner.snapshot()))
        if restart_after is not None:
            i, snapshot = snapshots[restart_after]
            emitted = h.emitted
            restored = Combiner(h.spec, 0, h.clock)
            restored.restore(snapshot)
            h = Harness(h.spec)
            h.combiner = restored
            h.emitted = list(emitted)  # what the crashed one had published
            for gateway, seq, rows in sends[i + 1 :]:  # re-sent: never confirmed
                h.send(gateway, seq, rows)
                h.tick()
        h.emitted.append(h.combiner.flush().frame)
        frame = pl.concat(h.emitted).select(COLUMNS)
        return frame.unique(["start", "key"], keep="last", maintain_order=True).sort("start", "key")

    never_stopped = run(None)
    for restart_after in range(len(sends)):
        assert run(restart_after).equals(never_stopped), restart_after
    assert never_stopped.height > 0
    assert set(never_stopped["key"]) == {"k", "j", "m"}


def test_a_checkpoint_with_the_pane_state_in_one_piece_is_still_read() -> None:
    """Checkpoints written before panes were packed one by one hold ``panes`` instead."""
    h = Harness(make_spec(windows=[PANED]))
    h.announce("gw")
    h.send("gw", 0, [("k", 1_100, 1.0), ("j", 1_900, 2.0), ("k", 2_500, 3.0)])
    snapshot = msgpack.unpackb(h.combiner.snapshot(), raw=False)
    assert h.combiner.state.panes is not None
    old = {k: v for k, v in snapshot.items() if k != "pane_chunks"}
    old["panes"] = h.combiner.state.panes.snapshot_rows().pack()  # type: ignore[union-attr]
    restored = Combiner(h.spec, 0, h.clock)
    restored.restore(msgpack.packb(old, use_bin_type=True))
    expected, got = h.combiner.flush().frame, restored.flush().frame
    assert got.height > 0
    assert got.equals(expected)
