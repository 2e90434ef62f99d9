"""Session windows without a broker: any split, order, duplication, workers and partitions
give the polars oracle's sessions, and the exact late counts (docs/guarantees.md)."""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from shoal.clock import FakeClock
from shoal.processors.aggregates import AGGREGATES
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.results import split_windows
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.state import ClosedWindows
from tests.support.datasets import GeneratedBatch, frame_of, make_batches
from tests.support.in_memory import check_against_oracle, statuses_for

ALL_AGGREGATES = [*AGGREGATES, "p50", "p95"]


def session_spec(
    partitions: int,
    *,
    gap_ms: int = 1_500,
    max_duration_ms: int | None = None,
    lateness_ms: int = 1_000,
    with_tumbling: bool = False,
) -> PipelineSpec:
    session: dict[str, object] = {"kind": "session", "gap_ms": gap_ms}
    if max_duration_ms is not None:
        session["max_duration_ms"] = max_duration_ms
    windows = [session, *([{"kind": "tumbling", "size_ms": 2_000}] if with_tumbling else [])]
    return parse_pipeline(
        {
            "name": "t",
            "windows": windows,
            "aggregates": ALL_AGGREGATES,
            "partitions": partitions,
            "lateness_ms": lateness_ms,
            "idle_timeout_ms": 1_000,
        }
    )


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_sessions_equal_the_oracle(partitions: int, workers: int) -> None:
    spec = session_spec(partitions, max_duration_ms=6_000, with_tumbling=True)
    batches = make_batches(
        seed=partitions * 10 + workers, gateways=3, batches_per_gateway=15, gap_every=4
    )
    combiners = check_against_oracle(spec, batches, seed=workers, workers=workers)
    closed = sum(c.counters.windows_closed for c in combiners)
    assert closed > 0
    assert sum(c.counters.rows_late for c in combiners) > 0


def test_sessions_close_while_data_flows() -> None:
    """Nearly in order: sessions close between batches, later pieces meet closed ones."""
    spec = session_spec(2, gap_ms=800, lateness_ms=300)
    batches = make_batches(seed=4, gateways=3, batches_per_gateway=25, gap_every=3)
    check_against_oracle(spec, batches, seed=4, reorder_within=3)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gateways=st.integers(1, 3),
    batches=st.integers(1, 10),
    gap_ms=st.sampled_from([300, 700, 1_400, 5_000]),
    max_duration_ms=st.sampled_from([None, 5_000, 20_000]),
    partitions=st.integers(1, 2),
    lateness_ms=st.sampled_from([0, 300, 2_000]),
    duplicate_fraction=st.floats(0.0, 1.0),
    reorder_within=st.sampled_from([None, 2, 5]),
)
def test_property_any_split_order_and_duplication(
    seed: int,
    gateways: int,
    batches: int,
    gap_ms: int,
    max_duration_ms: int | None,
    partitions: int,
    lateness_ms: int,
    duplicate_fraction: float,
    reorder_within: int | None,
) -> None:
    longest = None if max_duration_ms is None else max(max_duration_ms, gap_ms)
    spec = session_spec(partitions, gap_ms=gap_ms, max_duration_ms=longest, lateness_ms=lateness_ms)
    data = make_batches(seed=seed, gateways=gateways, batches_per_gateway=batches, gap_every=3)
    check_against_oracle(
        spec, data, seed=seed, duplicate_fraction=duplicate_fraction, reorder_within=reorder_within
    )


def _run(spec: PipelineSpec, batches: list[GeneratedBatch], restart_at: int | None) -> pl.DataFrame:
    """Deliver batches in seq order to one partition's combiner, restarting it from a
    snapshot after ``restart_at`` batches (and re-delivering those, as gateways re-send)."""
    clock = FakeClock()
    builder = PartialBuilder(spec, "w0")
    combiner = Combiner(spec, 0, clock)
    for status in statuses_for(batches, clock.now_ms()):
        combiner.receive_status(status)
    emitted: list[pl.DataFrame] = []
    order = sorted(range(len(batches)), key=lambda i: (batches[i].seq, batches[i].gateway_id))
    if restart_at is not None:
        order = order[:restart_at] + order[restart_at // 2 :]
    for position, index in enumerate(order):
        if position == restart_at:
            snapshot = combiner.snapshot()
            combiner = Combiner(spec, 0, clock)
            combiner.restore(snapshot)
        batch = batches[index]
        info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, "w0")
        for partial in builder.build(batch.frame, info, clock.now_ms()):
            combiner.receive(Partial.decode(partial.encode()))
        closed = combiner.tick().closed
        if closed is not None and not closed.empty:
            emitted.append(closed.frame)
        clock.advance(1)
    emitted.append(combiner.flush().frame)
    return pl.concat(emitted).sort("window", "start", "key")


def test_a_restart_from_a_snapshot_changes_nothing() -> None:
    """Open sessions (their ``last`` and sketches) survive a checkpoint: a combiner restored
    mid-stream, with re-sent batches, emits what an uninterrupted one does."""
    spec = session_spec(1, gap_ms=900, lateness_ms=200, max_duration_ms=4_000)
    batches = make_batches(seed=8, gateways=2, batches_per_gateway=20, gap_every=4)
    straight = _run(spec, batches, restart_at=None)
    assert straight.height > 10
    for restart_at in (5, 17, 31):
        # the same sessions and counts; float sums may round differently (merge order)
        assert_frame_equal(_run(spec, batches, restart_at), straight, rel_tol=1e-12)


def test_sessions_sharing_a_start_close_together_in_one_message() -> None:
    """t1's session [0, 1 s) may close before t2's [0, 3.7 s), but both start at 0: t1 waits,
    so the message for (window, start 0) is published once, with both keys."""
    spec = session_spec(1, gap_ms=1_000, lateness_ms=0)
    t0 = 1_700_000_000_000
    rows = [("t1", 0), ("t2", 0), ("t2", 900), ("t2", 1_800), ("t2", 2_700)]
    batches = [
        GeneratedBatch("gw", 0, frame_of([(k, t0 + ts, 1.0) for k, ts in rows])),
        GeneratedBatch("gw", 1, frame_of([("t3", t0 + 2_900, 1.0)])),
        GeneratedBatch("gw", 2, frame_of([("t3", t0 + 5_000, 1.0)])),
    ]
    clock = FakeClock()
    builder = PartialBuilder(spec, "w0")
    combiner = Combiner(spec, 0, clock)
    for status in statuses_for(batches, clock.now_ms()):
        combiner.receive_status(status)
    closes = []
    for batch in batches:
        info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, "w0")
        for partial in builder.build(batch.frame, info, clock.now_ms()):
            combiner.receive(partial)
        closed = combiner.tick().closed
        closes.append([] if closed is None else split_windows(closed.frame, {}, closed.sessions))
    # after seq 1 (watermark 2.9 s) t1's session could close alone; it waits for t2's
    assert closes[1] == []
    (message,) = [r for r in closes[2] if r.start == t0]
    assert sorted(message.frame["key"].to_list()) == ["t1", "t2"]
    assert message.end == t0 + 3_700
    assert sorted(message.frame["end"].to_list()) == [t0 + 1_000, t0 + 3_700]


def test_a_restart_in_the_timing_dependent_case_counts_each_row_once() -> None:
    """A session closed while a gateway was quiet is re-closed alike after a crash.

    Before the crash b's piece came after the close (late, ``window_closed``); the restored
    combiner, whose gateways count as active again, would take it on time and republish
    the session with it under an earlier start, unless it re-takes the logged close first.
    """
    spec = session_spec(1, gap_ms=1_000, lateness_ms=0)
    t0 = 1_700_000_000_000
    a0 = GeneratedBatch("a", 0, frame_of([("t1", t0, 1.0), ("t1", t0 + 200, 1.0)]))
    b0 = GeneratedBatch("b", 0, frame_of([("t2", t0 + 100, 1.0)]))
    a1 = GeneratedBatch("a", 1, frame_of([("t3", t0 + 5_000, 1.0)]))
    b1 = GeneratedBatch("b", 1, frame_of([("t1", t0 - 500, 1.0)]))  # joins t1's session
    clock = FakeClock(t0)
    builder = PartialBuilder(spec, "w0")
    messages: dict[tuple[str, int], int] = {}  # a consumer's view: identity -> rows
    late: dict[tuple[str, int], int] = {}
    log = bytearray()  # the close log's file, as the runtime writes it

    def persist(combiner: Combiner) -> None:
        write = combiner.take_log()
        if write is not None:
            log[:] = write.data if write.replace else bytes(log) + write.data

    def publish(closed: ClosedWindows | None) -> None:
        if closed is not None:
            for result in split_windows(closed.frame, {}, closed.sessions):
                messages.setdefault((result.window, result.start), result.rows)

    def deliver(combiner: Combiner, batch: GeneratedBatch) -> None:
        info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, "w0")
        for partial in builder.build(batch.frame, info, clock.now_ms()):
            step = combiner.receive(Partial.decode(partial.encode()))
            for report in step.late:
                late[(report.gateway_id, report.seq)] = report.rows
            for closed in step.replayed:
                publish(closed)
        step = combiner.tick()
        persist(combiner)
        publish(step.closed)

    combiner = Combiner(spec, 0, clock)
    for status in statuses_for([a0, b0], clock.now_ms()):  # b announces seq 0 only
        combiner.receive_status(status)
    deliver(combiner, a0)
    deliver(combiner, b0)
    checkpoint = combiner.snapshot()
    persist(combiner)
    clock.advance(spec.idle_timeout_ms + 1)  # b goes quiet; a goes on and closes t1's session
    deliver(combiner, a1)
    deliver(combiner, b1)  # b comes back: its piece is late (window_closed)
    assert late == {("b", 1): 1}
    first_copies = dict(messages)
    restored = Combiner(spec, 0, clock)  # a crash: back to the checkpoint, batches re-sent
    restored.restore(checkpoint, bytes(log))
    assert restored.replaying
    deliver(restored, b1)  # b counts as active again, but its piece waits for the close
    deliver(restored, a1)
    assert not restored.replaying
    assert restored.counters.closes_replayed >= 1
    assert late == {("b", 1): 1}
    clock.advance(spec.idle_timeout_ms + 1)
    publish(restored.flush())
    assert all(messages[k] == v for k, v in first_copies.items())
    assert sum(messages.values()) + sum(late.values()) == 5  # every row once


def test_without_the_close_log_the_restart_counts_a_row_twice() -> None:
    """The same crash restored from the checkpoint alone: the failure the log prevents."""
    spec = session_spec(1, gap_ms=1_000, lateness_ms=0)
    t0 = 1_700_000_000_000
    a0 = GeneratedBatch("a", 0, frame_of([("t1", t0, 1.0), ("t1", t0 + 200, 1.0)]))
    b0 = GeneratedBatch("b", 0, frame_of([("t2", t0 + 100, 1.0)]))
    a1 = GeneratedBatch("a", 1, frame_of([("t3", t0 + 5_000, 1.0)]))
    b1 = GeneratedBatch("b", 1, frame_of([("t1", t0 - 500, 1.0)]))
    clock = FakeClock(t0)
    builder = PartialBuilder(spec, "w0")
    messages: dict[tuple[str, int], int] = {}
    late = 0

    def deliver(combiner: Combiner, batch: GeneratedBatch) -> None:
        nonlocal late
        info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, "w0")
        for partial in builder.build(batch.frame, info, clock.now_ms()):
            late += sum(r.rows for r in combiner.receive(Partial.decode(partial.encode())).late)
        closed = combiner.tick().closed
        if closed is not None:
            for result in split_windows(closed.frame, {}, closed.sessions):
                messages.setdefault((result.window, result.start), result.rows)

    combiner = Combiner(spec, 0, clock)
    for status in statuses_for([a0, b0], clock.now_ms()):
        combiner.receive_status(status)
    deliver(combiner, a0)
    deliver(combiner, b0)
    checkpoint = combiner.snapshot()
    clock.advance(spec.idle_timeout_ms + 1)
    deliver(combiner, a1)
    deliver(combiner, b1)
    restored = Combiner(spec, 0, clock)
    restored.restore(checkpoint)
    assert not restored.replaying
    deliver(restored, a1)
    deliver(restored, b1)
    clock.advance(spec.idle_timeout_ms + 1)
    flushed = restored.flush()
    for result in split_windows(flushed.frame, {}, flushed.sessions):
        messages.setdefault((result.window, result.start), result.rows)
    assert sum(messages.values()) + late > 5
