"""The combiner's state cap: a partial that could grow open state beyond ``max_state_cells``
is refused whole, dead-lettered with its rows and counted; what was accepted is exact."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np
import pytest

from shoal.broker.memory import MemoryBroker
from shoal.clock import FakeClock
from shoal.errors import ConfigError, StateCapError
from shoal.processors.combine import Combiner
from shoal.processors.count import ROWS_PER_CELL
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import (
    DEFAULT_MAX_STATE_CELLS,
    MIN_DEFAULT_STATE_CELLS,
    STATE_CELL_BYTES,
    default_state_cells,
    parse_pipeline,
)
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support.state_cap import (
    capped_spec,
    check_capped,
    distinct_key_batches,
    keyed_frame,
    run_capped,
)


def test_the_cap_is_read_from_limits_with_a_default_and_checked() -> None:
    base = {"name": "c", "windows": [{"kind": "tumbling", "size_ms": 1_000}]}
    unset = parse_pipeline(base)
    assert unset.max_state_cells is None  # sized from memory when the combiner starts
    assert unset.state_cap(None) == DEFAULT_MAX_STATE_CELLS
    assert unset.state_cap(8 * 2**30) == default_state_cells(8 * 2**30)
    fixed = parse_pipeline({**base, "limits": {"max_state_cells": 5_000}})
    assert fixed.max_state_cells == 5_000
    assert fixed.state_cap(None) == fixed.state_cap(8 * 2**30) == 5_000
    for bad in (0, 999, -1, "many", 2.5):
        with pytest.raises(ConfigError, match="max_state_cells") as caught:
            parse_pipeline({**base, "limits": {"max_state_cells": bad}})
        assert caught.value.field == "limits.max_state_cells"


def test_the_default_cap_is_a_quarter_of_the_memory_at_the_bytes_a_cell_costs() -> None:
    gib = 2**30
    assert default_state_cells(4 * gib) == gib // STATE_CELL_BYTES  # ~3.6 M cells at 4 GiB
    assert default_state_cells(64 * gib) == 16 * gib // STATE_CELL_BYTES  # ~57 M
    # however small the device, the cap leaves room for a working state
    assert default_state_cells(64 * 2**20) == MIN_DEFAULT_STATE_CELLS
    assert default_state_cells(None) == DEFAULT_MAX_STATE_CELLS


def test_a_combiner_core_sizes_its_cap_from_the_memory_it_is_given() -> None:
    spec = parse_pipeline({"name": "c", "windows": [{"kind": "tumbling", "size_ms": 1_000}]})
    assert Combiner(spec, 0, FakeClock(), memory_bytes=2 * 2**30).state_cap == (
        default_state_cells(2 * 2**30)
    )
    assert Combiner(spec, 0, FakeClock()).state_cap == DEFAULT_MAX_STATE_CELLS


Sender = Callable[[int, list[str], int], tuple[int, list[tuple[Partial, StateCapError]]]]


def capped_core(
    window: dict[str, object], spread_ms: int, *, p50: bool = False
) -> tuple[Combiner, Sender]:
    """A combiner capped at 1,000 cells, one gateway announced, and a sender of batches
    (seq, one row per key name at ts, ts + spread_ms, ...) -> (applied, over cap)."""
    spec = parse_pipeline(
        {
            "name": "c",
            "windows": [window],
            "aggregates": ["count", "sum", *(["p50"] if p50 else [])],
            "lateness_ms": 0,
            "idle_timeout_ms": 1_000,
            "limits": {"max_state_cells": 1_000},
        }
    )
    clock = FakeClock()
    builder = PartialBuilder(spec, "w1")
    core = Combiner(spec, 0, clock)
    core.receive_status(GatewayStatus("g", "s", 10, 0, 10, 0, None, 0, 0, 0))

    def send(
        seq: int, names: list[str], ts: int
    ) -> tuple[int, list[tuple[Partial, StateCapError]]]:
        rows = len(names)
        frame = keyed_frame(names, ts + spread_ms * np.arange(rows, dtype=np.int64), np.ones(rows))
        batch = BatchInfo("g", seq, "s", 0, None, None, 0, 0, "w1")
        step = core.receive(builder.build(frame, batch, clock.now_ms())[0])
        return step.applied, step.over_cap

    return core, send


def test_count_windows_count_their_buffered_rows_against_the_cap() -> None:
    # count-window partials carry rows (``events``), not state: they were never capped
    # a buffered row is 36 bytes, a cell of merged state ~250: ROWS_PER_CELL rows a cell
    core, send = capped_core({"kind": "count", "n": 1_000_000}, spread_ms=1)
    rows = 600 * ROWS_PER_CELL - 3  # 600 cells, the last one part full
    assert send(0, ["k"] * rows, 100) == (1, [])
    held = core.state_cells
    assert held >= 600  # the rows wait for their window of a million to fill
    applied, refused = send(1, ["k"] * rows, 100_000)
    assert applied == 0
    [(partial, error)] = refused
    assert partial.events is not None
    assert (error.cells, error.incoming, error.cap) == (held, 600, 1_000)
    assert core.state_cells == held  # nothing of it applied
    assert send(2, ["k"] * (300 * ROWS_PER_CELL), 100_000) == (1, [])  # 300 cells fit


def test_session_sketch_cells_count_against_the_cap() -> None:
    core, send = capped_core({"kind": "session", "gap_ms": 10_000}, spread_ms=1, p50=True)
    assert send(0, [f"k{i}" for i in range(300)], 100) == (1, [])
    # 300 sessions, each with one sketch cell: both count, as the incoming side counted them
    assert core.state_cells == 600
    applied, refused = send(1, [f"j{i}" for i in range(300)], 1_000)
    assert applied == 0
    [(_, error)] = refused
    assert (error.cells, error.incoming) == (600, 600)


def test_a_partial_over_the_cap_is_refused_whole_and_its_seq_moves_on() -> None:
    core, sender = capped_core({"kind": "tumbling", "size_ms": 1_000}, spread_ms=0)

    def send(seq: int, keys: int, ts: int) -> tuple[int, list[tuple[Partial, StateCapError]]]:
        return sender(seq, [f"k{seq}-{i}" for i in range(keys)], ts)

    assert send(0, 600, 100) == (1, [])
    applied, refused = send(1, 600, 200)  # 600 + 600 > 1,000: refused whole
    assert applied == 0
    [(partial, error)] = refused
    assert (partial.batch.gateway_id, partial.batch.seq) == ("g", 1)
    assert partial.rows is not None
    assert len(partial.rows) == 600
    assert (error.reason, error.cells, error.incoming, error.cap) == (
        "state_cap_exceeded",
        600,
        600,
        1_000,
    )
    assert error.as_record()["code"] == "state_cap_exceeded"
    assert core.counters.partials_over_cap == 1
    assert core.state_cells == 600  # nothing of it applied
    assert core.tracker.gateways["g"].applied_through == 1  # handled: the seq moves on
    assert core.confirmable() == {"g": 1}
    assert core.tracker.watermark("g") == 200  # its event times count as progress
    # A small batch still fits and moves the watermark on; the window it passes closes,
    # its state frees, and a batch as large as the refused one is taken again.
    assert send(2, 10, 1_500) == (1, [])
    closed = core.tick().closed
    assert closed is not None
    assert closed.frame["rows"].sum() == 600
    assert core.state_cells == 10
    assert send(3, 600, 1_600) == (1, [])
    assert core.counters.partials_over_cap == 1


def test_a_batch_refused_after_the_checkpoint_is_refused_again_after_a_restore() -> None:
    spec = parse_pipeline(
        {
            "name": "c",
            "windows": [{"kind": "tumbling", "size_ms": 1_000}],
            "aggregates": ["count", "p50"],
            "limits": {"max_state_cells": 1_500},
        }
    )
    clock = FakeClock()
    builder = PartialBuilder(spec, "w1")

    def partial(seq: int, keys: int) -> Partial:
        names = [f"k{seq}-{i}" for i in range(keys)]
        frame = keyed_frame(names, np.full(keys, 100 + seq, np.int64), np.ones(keys))
        batch = BatchInfo("g", seq, "s", 0, None, None, 0, 0, "w1")
        return builder.build(frame, batch, clock.now_ms())[0]

    first = Combiner(spec, 0, clock)
    first.receive_status(GatewayStatus("g", "s", 10, 0, 10, 0, None, 0, 0, 0))
    assert first.receive(partial(0, 500)).applied == 1  # 500 rows + 500 sketch buckets
    snapshot = first.snapshot()
    [(_, before)] = first.receive(partial(1, 500)).over_cap
    again = Combiner(spec, 0, clock)
    again.restore(snapshot)
    assert again.counters.partials_over_cap == 0  # the refusal came after the checkpoint
    [(_, after)] = again.receive(partial(1, 500)).over_cap
    assert after.as_record() == before.as_record()
    assert again.state_cells == first.state_cells == 1_000


def test_a_million_keys_past_a_low_cap(tmp_path, caplog) -> None:
    """1M distinct keys in 10 batches through worker and combiner, cap 250,000 cells: the
    batches that would pass it are dead-lettered whole (every row in the record), counted in
    the heartbeat and logged once per episode; every accepted row is in the results,
    exactly as polars computes them from the accepted batches alone."""
    caplog.set_level(logging.INFO, logger="shoal.runtime.combiner")
    memory = MemoryBroker()
    spec = capped_spec("capped", 250_000)
    batches = distinct_key_batches(10, 100_000)
    run = asyncio.run(
        run_capped(
            spec, batches, memory.settings, Topics(root="capped"), tmp_path, memory.session_factory
        )
    )
    refused = check_capped(spec, batches, run, caplog.records)
    assert sum(b.frame.height for b in batches) == 1_000_000
    assert len(refused) >= 2  # 10 batches, at most 2 fit the cap per window
