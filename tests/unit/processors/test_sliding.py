"""Sliding windows in the combiner core: the trigger, corrections that trigger, checkpoints.

A sliding window ``[end - size, end)`` is a result for a key only if the key has a row in its
last step ``[end - step, end)`` (docs/architecture.md, "Window kinds"; the arithmetic's own
table is in ``test_windows.py``, the oracle runs in ``test_exactness_in_memory.py``).
"""

from __future__ import annotations

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
