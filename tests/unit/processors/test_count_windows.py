"""Count windows: settings, the ordering core, and exactness against the polars oracle.

Every n rows of a key in the order (ts, gateway, seq, row) form a window, whatever the batch
split, the worker that saw a batch, the arrival order, duplicates or a combiner restart.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.clock import FakeClock
from shoal.errors import ConfigError, SchemaError
from shoal.processors.aggregates import AGGREGATES
from shoal.processors.combine import COUNT_CLOSE_INTERVAL_MS, Combiner
from shoal.processors.partials import BatchInfo, EventRows, Partial, PartialBuilder
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.windows import COUNT, WindowSpec
from tests.support.compare import assert_count_windows_match
from tests.support.datasets import GeneratedBatch, all_rows, frame_of, make_batches
from tests.support.in_memory import run_in_memory, statuses_for
from tests.support.oracle import expected_count_results

ALL_AGGREGATES = [*AGGREGATES, "p50", "p99"]


def spec_for(windows: list[dict], partitions: int = 1, lateness_ms: int = 1_000, **more):
    """A count-window spec. Gateways stay active for a minute of the fake clock: the tests
    move it up to ``COUNT_CLOSE_INTERVAL_MS`` a delivery (a close step each), and a gateway
    that went idle or was released meanwhile would make timing-dependent late rows."""
    return parse_pipeline(
        {
            "name": "c",
            "windows": windows,
            "aggregates": ALL_AGGREGATES,
            "partitions": partitions,
            "lateness_ms": lateness_ms,
            "idle_timeout_ms": 60_000,
            "limits": {"max_future_ms": False},
            **more,
        }
    )


# -- settings -------------------------------------------------------------------------------


def test_count_window_settings() -> None:
    spec = spec_for([{"kind": "count", "n": 5}, {"kind": "count", "count": 7, "name": "seven"}])
    assert [(w.name, w.count, w.size_ms) for w in spec.windows] == [
        ("count-5", 5, 1),
        ("seven", 7, 1),
    ]
    assert all(w.by_count for w in spec.windows)


@pytest.mark.parametrize(
    ("windows", "more", "field"),
    [
        ([{"kind": "count"}], {}, "windows[0].n"),
        ([{"kind": "count", "n": 0}], {}, "windows[0].n"),
        ([{"kind": "count", "n": 2_000_000}], {}, "windows[0].n"),
        ([{"kind": "count", "n": 3, "size_ms": 1_000}], {}, "windows[0].size_ms"),
        ([{"kind": "count", "n": 3, "count": 3}], {}, "windows[0].count"),
        ([{"kind": "count", "n": 3, "bogus": 1}], {}, "windows[0].bogus"),
        ([{"kind": "count", "n": 3}, {"kind": "tumbling", "size_ms": 1_000}], {}, "windows"),
        ([{"kind": "count", "n": 3}], {"allowed_lateness_ms": 1_000}, "allowed_lateness_ms"),
    ],
)
def test_count_window_settings_refused(windows, more, field) -> None:
    with pytest.raises(ConfigError) as caught:
        spec_for(windows, **more)
    assert caught.value.field == field


def test_count_windows_change_the_fingerprint() -> None:
    from shoal.processors.partials import spec_fingerprint  # noqa: PLC0415

    three, four = spec_for([{"kind": "count", "n": 3}]), spec_for([{"kind": "count", "n": 4}])
    same_name = spec_for([{"kind": "count", "n": 4, "name": "count-3"}])
    assert len({spec_fingerprint(s) for s in (three, four, same_name)}) == 3


# -- the kind's references --------------------------------------------------------------------


def test_with_count_index_numbers_rows_in_event_order() -> None:
    window = WindowSpec("c", "count", 1, 1, count=2)
    frame = pl.DataFrame(
        {
            "key": ["a", "a", "a", "b", "a", "a"],
            "ts": [5, 5, 5, 1, 3, 9],
            "gateway_id": ["g2", "g1", "g1", "g1", "g9", "g0"],
            "seq": [0, 4, 3, 0, 0, 0],
            "row": [0, 1, 7, 0, 2, 0],
        }
    )
    got = COUNT.with_count_index(frame, window)
    # key a in order: ts3 | ts5 g1 s3 | ts5 g1 s4 | ts5 g2 | ts9  -> windows 0,0,1,1,2
    a = got.filter(pl.col("key") == "a")
    assert a["ts"].to_list() == [3, 5, 5, 5, 9]
    assert a["gateway_id"].to_list() == ["g9", "g1", "g1", "g2", "g0"]
    assert a["seq"].to_list() == [0, 3, 4, 0, 0]
    assert a["index"].to_list() == [0, 0, 1, 1, 2]
    assert got.filter(pl.col("key") == "b")["index"].to_list() == [0]


@pytest.mark.parametrize("ts", [-(2**53), -1, 0, 1, 2**53])
def test_count_kind_judges_each_row_as_its_own_millisecond(ts: int) -> None:
    window = WindowSpec("c", "count", 1, 1, count=3)
    assert COUNT.window_starts(ts, window) == [ts]
    assigned = COUNT.assign(np.array([ts, ts + 5], dtype=np.int64), window)
    assert assigned.starts(assigned.slot).tolist() == [ts, ts + 5]


# -- wire --------------------------------------------------------------------------------------


def test_partials_carry_rows_by_partition_through_the_wire() -> None:
    spec = spec_for([{"kind": "count", "n": 3}], partitions=2)
    frame = frame_of([("a", 10, 1.0), ("b", 11, 2.0), ("a", 9, 3.0), ("c", 12, 4.0)])
    info = BatchInfo("gw", 4, "s", 0, None, None, 0, 0, "w")
    partials = [Partial.decode(p.encode()) for p in PartialBuilder(spec, "w").build(frame, info, 0)]
    assert [p.rows for p in partials] == [None, None]
    seen = []
    for p in partials:
        if p.events is None:
            continue
        events = p.events
        seen += [
            (events.keys[k], t, r, v)
            for k, t, r, v in zip(events.key, events.ts, events.row, events.value, strict=True)
        ]
    assert sorted(seen) == [
        ("a", 9, 2, 3.0),
        ("a", 10, 0, 1.0),
        ("b", 11, 1, 2.0),
        ("c", 12, 3, 4.0),
    ]


def test_a_bad_event_key_index_is_refused() -> None:
    packed = EventRows(["a"], np.array([0]), np.array([1]), np.array([0]), np.array([1.0])).pack()
    packed["key"] = [5, "u1", b"\x00"]
    with pytest.raises(SchemaError):
        EventRows.unpack(packed)


# -- exactness -------------------------------------------------------------------------------


def check(
    spec,
    batches,
    *,
    seed,
    workers=3,
    duplicate_fraction=0.3,
    reorder_within=None,
    advance_ms=COUNT_CLOSE_INTERVAL_MS,
):
    """Through ``run_in_memory`` against the oracle; by default a close step after every
    delivery (the clock moves a whole ``COUNT_CLOSE_INTERVAL_MS`` each time)."""
    emitted, late, combiners = run_in_memory(
        spec,
        batches,
        seed=seed,
        workers=workers,
        duplicate_fraction=duplicate_fraction,
        reorder_within=reorder_within,
        advance_ms=advance_ms,
    )
    marks = [c.closed_through for c in combiners if c.closed_through is not None]
    threshold = max(marks) if marks else -(2**62)
    expected, late_count, scale = expected_count_results(
        all_rows(batches), spec, threshold=threshold
    )
    if expected.height == 0:
        assert emitted.height == 0
    else:
        assert_count_windows_match(emitted, expected, spec, scale)
    assert sum(item.rows for item in late) == late_count * 1
    assert sum(c.counters.rows_late for c in combiners) == late_count
    return emitted, late_count, combiners


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_count_windows_equal_the_oracle(partitions: int, workers: int) -> None:
    spec = spec_for([{"kind": "count", "n": 7}, {"kind": "count", "n": 20}], partitions)
    batches = make_batches(seed=partitions * 10 + workers, gateways=3, batches_per_gateway=15)
    emitted, late_count, _ = check(spec, batches, seed=workers, workers=workers)
    assert emitted.height > 20
    assert late_count > 0


def test_equal_timestamps_are_ordered_by_gateway_seq_and_row() -> None:
    """Many rows share a timestamp across gateways, batches and rows: first/last, min and max
    of each window depend on the tie order."""
    batches = [
        GeneratedBatch(
            f"gw{g}",
            s,
            frame_of([("k", 1_000 * s + (r % 2), float(10 * g + r + s)) for r in range(5)]),
        )
        for g in (2, 0, 1)
        for s in range(4)
    ]
    spec = spec_for([{"kind": "count", "n": 4}], lateness_ms=0)
    for seed in range(5):
        check(spec, batches, seed=seed, reorder_within=None, duplicate_fraction=0.5)


def test_flush_emits_unfinished_windows_with_fewer_rows() -> None:
    spec = spec_for([{"kind": "count", "n": 4}])
    clock = FakeClock()
    combiner = Combiner(spec, 0, clock)
    batches = [
        GeneratedBatch("gw", s, frame_of([("a", 100 * s + r, float(r)) for r in range(3)]))
        for s in range(3)
    ]
    for status in statuses_for(batches, clock.now_ms()):
        combiner.receive_status(status)
    builder = PartialBuilder(spec, "w")
    for b in batches:
        info = BatchInfo(b.gateway_id, b.seq, "s", 0, None, None, 0, 0, "w")
        for p in builder.build(b.frame, info, 0):
            combiner.receive(p)
    flushed = combiner.flush().frame
    assert flushed["rows"].to_list() == [4, 4, 1]
    assert flushed["index"].to_list() == [0, 1, 2]
    assert flushed["first_ts"].to_list() == [0, 101, 202]
    assert flushed["last_ts"].to_list() == [100, 201, 202]
    expected, _, _ = expected_count_results(all_rows(batches), spec, flush=True)
    assert expected["rows"].to_list() == [4, 4, 1]
    # after the flush, rows before its end are late; later ones start the next window
    after = builder.build(
        frame_of([("a", 150, 1.0), ("a", 500, 2.0)]),
        BatchInfo("gw", 3, "s", 0, None, None, 0, 0, "w"),
        0,
    )
    late = combiner.receive(Partial.decode(after[0].encode())).late
    assert late[0].frame["reason"].to_list() == ["window_closed"]
    assert late[0].frame["start"].to_list() == [150]
    assert combiner.flush().frame["index"].to_list() == [3]


def test_late_rows_and_their_reasons_at_the_bounds() -> None:
    """A row is late as its 1 ms window ``[ts, ts + 1)`` would be: ended ``lateness_ms`` or
    more before its gateway's watermark (``behind_watermark``, which wins), or at or before
    ``closed_through`` (``window_closed``). Rows on both sides of both bounds, against that
    rule row by row; the on-time rows of the batch are buffered, the late ones reported."""
    spec = spec_for([{"kind": "count", "n": 2}], lateness_ms=1_000, idle_timeout_ms=10_000)
    clock = FakeClock()
    combiner = Combiner(spec, 0, clock)
    builder = PartialBuilder(spec, "w")

    def send(gateway: str, seq: int, rows: list[tuple[str, int, float]]) -> list:
        info = BatchInfo(gateway, seq, "s", 0, None, None, 0, 0, "w")
        late = []
        for p in builder.build(frame_of(rows), info, clock.now_ms()):
            late += combiner.receive(Partial.decode(p.encode())).late
        return late

    # announced: the busy gateway always has batches on the way (it holds the watermark)
    announced = [("quiet", 0), ("busy", 0), ("busy", 99)]
    batches = [GeneratedBatch(g, seq, frame_of([])) for g, seq in announced]
    for status in statuses_for(batches, clock.now_ms()):
        combiner.receive_status(status)
    send("quiet", 0, [("k", 5_100, 1.0)])
    send("busy", 0, [("k", 20_000, 1.0)])
    clock.advance(spec.idle_timeout_ms + 1)  # the quiet gateway no longer holds windows
    send("busy", 1, [("k", 20_500, 2.0)])
    combiner.tick()
    watermark, closed = combiner.tracker.watermark("quiet"), combiner.closed_through
    assert watermark is not None
    assert closed is not None
    assert watermark - spec.lateness_ms < closed  # both reasons can happen
    times = [watermark - spec.lateness_ms + d for d in (-1, 0)] + [closed + d for d in (-1, 0, 9)]
    assert combiner.counts is not None
    buffered = combiner.counts._pending_rows
    late = send("quiet", 1, [(f"k{i}", ts, float(i)) for i, ts in enumerate(times)])

    def reason(ts: int) -> str | None:
        if ts + 1 + spec.lateness_ms <= watermark:
            return "behind_watermark"
        return "window_closed" if ts + 1 <= closed else None

    expected = [(ts, ts + 1, float(i), reason(ts)) for i, ts in enumerate(times) if reason(ts)]
    [item] = late
    got = item.frame.sort("start").select("start", "end", "sum", "reason").rows()
    assert got == expected
    assert [r for *_, r in expected] == ["behind_watermark", *["window_closed"] * 2]
    assert combiner.counts._pending_rows - buffered == len(times) - len(expected)


def test_a_restored_combiner_carries_buffered_rows_tails_and_counts() -> None:
    """Snapshot at every step, restore into a fresh combiner, go on: same results."""
    spec = spec_for([{"kind": "count", "n": 5}, {"kind": "count", "n": 9}], lateness_ms=300)
    batches = make_batches(seed=4, gateways=2, batches_per_gateway=12)
    clock = FakeClock()
    combiner, frames = _feed_restoring(spec, batches, clock, lambda _: True)
    clock.advance(spec.idle_timeout_ms + 1)
    closed = combiner.tick().closed
    if closed is not None:
        frames.append(closed.frame)
    emitted = pl.concat(frames)
    assert combiner.counts is not None
    assert combiner.counts.tail_rows > 0
    expected, _, scale = expected_count_results(
        all_rows(batches), spec, threshold=combiner.closed_through
    )
    assert_count_windows_match(emitted, expected, spec, scale)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gateways=st.integers(1, 3),
    batches=st.integers(1, 10),
    n=st.sampled_from([1, 2, 3, 10]),
    partitions=st.integers(1, 2),
    workers=st.integers(1, 5),
    lateness_ms=st.sampled_from([0, 300, 2_000]),
    duplicate_fraction=st.floats(0.0, 1.0),
    reorder_within=st.sampled_from([None, 2, 5]),
    advance_ms=st.sampled_from([1, COUNT_CLOSE_INTERVAL_MS // 3, COUNT_CLOSE_INTERVAL_MS]),
)
def test_property_any_split_worker_order_and_duplication(
    seed,
    gateways,
    batches,
    n,
    partitions,
    workers,
    lateness_ms,
    duplicate_fraction,
    reorder_within,
    advance_ms,
) -> None:
    spec = spec_for([{"kind": "count", "n": n}], partitions, lateness_ms)
    data = make_batches(
        seed=seed, gateways=gateways, batches_per_gateway=batches, gap_every=3, keys=4
    )
    check(
        spec,
        data,
        seed=seed,
        workers=workers,
        duplicate_fraction=duplicate_fraction,
        reorder_within=reorder_within,
        advance_ms=advance_ms,
    )


def test_close_steps_follow_the_clock_and_every_final_window_closes() -> None:
    """Count windows close at most once per ``COUNT_CLOSE_INTERVAL_MS`` of the clock however
    fast the threshold moves; once input stops, the next tick after the interval closes
    every window whose rows are final (no event-time cadence that could stall)."""
    spec = spec_for([{"kind": "count", "n": 3}], lateness_ms=0)
    batches = [
        GeneratedBatch(f"gw{g}", s, frame_of([(f"k{g}", 100 * s + r, float(r)) for r in range(4)]))
        for s in range(20)
        for g in range(2)
    ]
    clock = FakeClock()
    builder, combiner = _announced(spec, batches, clock)
    frames, closes = [], 0
    for b in batches:  # one batch every 10 ms: the threshold moves with every other one
        _apply(builder, combiner, b, clock.now_ms())
        before = combiner.closed_through
        closed = combiner.close_ready(clock.now_ms())
        closes += combiner.closed_through != before
        frames += [] if closed is None else [closed.frame]
        clock.advance(10)
    # 400 ms of clock: at most one close step per interval (and the first at once)
    assert 1 <= closes <= 1 + 400 // COUNT_CLOSE_INTERVAL_MS
    threshold = combiner.close_threshold(clock.now_ms())
    assert threshold is not None
    assert combiner.closed_through is not None
    assert combiner.closed_through < threshold  # the last advances wait for the clock
    assert combiner.tick().closed is None or combiner.closed_through < threshold
    clock.advance(COUNT_CLOSE_INTERVAL_MS)  # no input, only time: the tick closes
    closed = combiner.tick().closed
    frames += [] if closed is None else [closed.frame]
    assert combiner.closed_through == threshold
    expected, _, scale = expected_count_results(all_rows(batches), spec, threshold=threshold)
    assert expected.height > 20
    assert_count_windows_match(pl.concat(frames), expected, spec, scale)


def test_a_clock_that_stands_still_closes_every_count_close_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the clock does not move (an archive replay), a close step is due once
    ``COUNT_CLOSE_ROWS`` rows were applied since the last one: the buffer stays bounded."""
    from shoal.processors import combine  # noqa: PLC0415 - the row budget is patched

    monkeypatch.setattr(combine, "COUNT_CLOSE_ROWS", 40)
    spec = spec_for([{"kind": "count", "n": 3}], lateness_ms=0)
    batches = [
        GeneratedBatch("gw", s, frame_of([(f"k{r % 2}", 100 * s + r, float(r)) for r in range(10)]))
        for s in range(30)
    ]
    clock = FakeClock()
    builder, combiner = _announced(spec, batches, clock)
    closes, buffered = 0, []
    for b in batches:
        _apply(builder, combiner, b, clock.now_ms())
        before = combiner.closed_through
        combiner.close_ready(clock.now_ms())
        closes += combiner.closed_through != before
        assert combiner.counts is not None
        buffered.append(combiner.counts._pending_rows)
    assert closes == 1 + (30 - 1) * 10 // 40  # the first at once, then one per 40 rows
    assert max(buffered) <= 40 + 10


def test_unfinished_windows_are_folded_state_not_rows() -> None:
    """Rows ranked into an unfinished window leave only state behind: entries per batch and
    per sketch bucket, whatever the number of rows; the flushed window is still exact."""
    spec = spec_for([{"kind": "count", "n": 100_000}], lateness_ms=0)
    values = [float(v % 10) for v in range(4_000)]
    batches = [
        GeneratedBatch("gw", s, frame_of([("k", 10_000 * s + r, values[r]) for r in range(4_000)]))
        for s in range(3)
    ]
    clock = FakeClock()
    builder = PartialBuilder(spec, "w")
    combiner = Combiner(spec, 0, clock)
    for status in statuses_for(batches, 0):
        combiner.receive_status(status)
    for b in batches:
        info = BatchInfo(b.gateway_id, b.seq, "s", 0, None, None, 0, 0, "w")
        (partial,) = builder.build(b.frame, info, 0)
        combiner.receive(partial)
        combiner.tick()
        clock.advance(COUNT_CLOSE_INTERVAL_MS)
    assert combiner.counts is not None
    held = combiner.counts._tails[0]  # the folded layout is what is tested
    # every row but the newest is final (lateness 0): ranked into the unfinished window
    assert combiner.counts.tail_rows == int(held.count.sum()) == 11_999
    # entries per batch and per sketch bucket (a step adds its own), not per row
    assert len(held.batches) <= 5
    assert len(held.batches.all()) == 3
    assert len(held.cells) <= 30
    assert len(held.cells.all()) <= 10
    restored = Combiner(spec, 0, clock)
    restored.restore(combiner.snapshot())
    frames = [c.flush().frame for c in (combiner, restored)]
    assert frames[0].equals(frames[1])
    expected, _, scale = expected_count_results(all_rows(batches), spec, flush=True)
    assert_count_windows_match(frames[0], expected, spec, scale)


def test_latest_revisions_identify_count_windows_by_index() -> None:
    """Re-published after a restart in a message of another start: still one window."""
    from shoal.schemas.results import latest_revisions  # noqa: PLC0415

    frame = pl.DataFrame(
        {
            "pipeline": ["p"] * 4,
            "window": ["count-2"] * 4,
            "start": [100, 100, 250, 100],  # the close step's span start
            "partition": [0] * 4,
            "revision": [1] * 4,
            "key": ["a", "a", "a", "b"],
            "rows": [2] * 4,
            "index": [0, 1, 1, 0],
        }
    )
    latest = latest_revisions(frame)
    assert sorted(zip(latest["key"], latest["index"], strict=True)) == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
    ]
    assert "_slot" not in latest.columns


def test_a_checkpoint_with_unfinished_windows_as_rows_is_folded_on_restore() -> None:
    """The earlier layout (``tails``: each key's final rows) restores into folded state."""
    from shoal.processors.count import CountState, _Rows  # noqa: PLC0415

    spec = spec_for([{"kind": "count", "n": 5}])
    rows = _Rows(
        np.array([1, 0, 0, 1, 0], dtype=np.int32),
        np.array([10, 11, 12, 13, 14], dtype=np.int64),
        np.zeros(5, dtype=np.int32),
        np.array([0, 0, 1, 1, 1], dtype=np.int64),
        np.array([0, 1, 0, 1, 2], dtype=np.int32),
        np.array([1.0, 2.0, 3.0, 4.0, 5.0]),
    )
    state = CountState(spec, spec.plan())
    state.restore(
        {
            "keys": ["a", "b"],
            "gateways": ["gw"],
            "pending": [],
            "tails": [[rows.pack()]],
            "done": [np.array([2, 0], dtype="<i8").tobytes()],
        }
    )
    assert state.tail_rows == 5
    frame = state.finalise(0, (0, 20), flush=True).sort("key")
    assert frame.select("key", "count", "sum", "index", "first_ts", "last_ts").rows() == [
        ("a", 3, 10.0, 2, 11, 14),
        ("b", 2, 5.0, 0, 10, 13),
    ]
    assert frame["batches"].to_list() == [2, 2]


def test_entry_chunks_take_by_key_merge_repeats_and_stay_bounded() -> None:
    """Unfinished windows' entries: a key's leave all at once; repeats merge; chunks bounded."""
    from shoal.processors.count import (  # noqa: PLC0415
        MAX_ENTRY_CHUNKS,
        _distinct,
        _Entries,
        _EntryStore,
    )

    def entries(keys: list[int], seqs: list[int]) -> _Entries:
        n = len(keys)
        return _Entries(np.array(keys, np.int32), np.zeros(n, np.int64), np.array(seqs, np.int64))

    store = _EntryStore(_distinct)
    for step in range(MAX_ENTRY_CHUNKS + 50):  # key 2 stops after the first step
        # key 0 sends batch `step` twice in a step; key 1 repeats batch 0 every step
        store.add(
            entries([0, 0, 1] + ([] if step else [2]), [step, step, 0] + ([] if step else [9]))
        )
        if step % 7 == 6:
            taken = store.take(np.array([0]))
            assert sorted(set(taken.b.tolist())) == list(range(max(step - 6, 0), step + 1))
    assert len(store.chunks) <= MAX_ENTRY_CHUNKS
    held = store.all()
    assert held.key.tolist().count(1) == 1  # batch 0 of key 1, once
    assert held.b[held.key == 2].tolist() == [9]
    assert len(store) <= 2 * len(held) + 65_536


# -- the close step's sorts (issue 14: count windows at 100,000 keys) -----------------------

entries_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 5), st.integers(0, 2**40)), max_size=80
)


@settings(max_examples=200, deadline=None)
@given(entries=entries_strategy, wide=st.booleans())
def test_distinct_batches_packed_equal_the_three_key_sort(
    entries: list[tuple[int, int, int]], wide: bool
) -> None:
    """One sort of packed (key, gateway, seq) gives what the lexsort gives; seqs too far
    apart to pack fall back to the lexsort."""
    key = np.array([e[0] for e in entries], dtype=np.int32)
    a = np.array([e[1] for e in entries], dtype=np.int64)
    b = np.array([e[2] for e in entries], dtype=np.int64)
    if wide and len(b):
        b[0] = 2**62  # spans more than 63 bits with the key and gateway bits
    from shoal.processors.count import _distinct, _distinct_lexsort, _Entries  # noqa: PLC0415

    got = _distinct(_Entries(key, a, b))
    want = _distinct_lexsort(_Entries(key, a, b))
    for column in ("key", "a", "b"):
        assert getattr(got, column).tolist() == getattr(want, column).tolist()
    assert got.key.dtype == np.int32


@settings(max_examples=100, deadline=None)
@given(
    batches=st.lists(
        st.tuples(
            st.sampled_from(["gw-b", "gw-a", "gw-c"]),
            st.integers(0, 6),
            st.lists(st.tuples(st.integers(0, 9), st.integers(-5, 5)), min_size=1, max_size=12),
        ),
        max_size=8,
        unique_by=lambda b: (b[0], b[1]),
    ),
    cut=st.integers(-6, 6),
)
def test_final_rows_come_out_in_event_order(
    batches: list[tuple[str, int, list[tuple[int, int]]]], cut: int
) -> None:
    """Chunks concatenated by (gateway name, seq) and sorted once by (key, ts) give the
    five-key lexsort's order (``COUNT_ORDER`` within each key), with every column read
    back from the packed sort or gathered to the right row."""
    from shoal.processors.count import CountState, _Rows  # noqa: PLC0415

    spec = spec_for([{"kind": "count", "n": 3}])
    state = CountState(spec, spec.plan())
    values: list[float] = []
    for gateway, seq, rows in batches:
        keys = sorted({f"k{k}" for k, _ in rows})
        events = EventRows(
            keys=list(keys),
            key=np.array([keys.index(f"k{k}") for k, _ in rows], dtype=np.int64),
            ts=np.array([t for _, t in rows], dtype=np.int64),
            row=np.arange(len(rows), dtype=np.int64) * 2,
            value=np.arange(len(rows)) + 100.0 * len(values),  # a row's identity
        )
        values.extend(events.value.tolist())
        state.add(events, gateway, seq, np.ones(len(rows), dtype=bool))
    chunks = state._take_final(cut, flush=False)
    got = state._in_event_order(chunks)
    everything = _Rows.concat(chunks)
    want = everything.take(state._event_order(everything))
    # values are distinct: the same values in the same order are the same rows in it
    for column in ("key", "ts", "gateway", "seq", "value"):
        assert getattr(got, column).tolist() == getattr(want, column).tolist()


@pytest.mark.parametrize("span", [10, 70_000, 2**31 + 5])
@pytest.mark.parametrize("top_key", [4, 70_000])
def test_buffered_rows_pack_compactly_and_round_trip(span: int, top_key: int) -> None:
    """A chunk of one batch packs its gateway and seq as numbers, key ids and time offsets
    as uint16 when they fit (else int32; times as int64 beyond that) and no row numbers
    while they increase: 12 bytes a row at best, not 36. Row numbers come back as their
    order; other chunks pack every column."""
    from shoal.processors.count import _Rows  # noqa: PLC0415 - the packed layout is tested

    n = 5
    one = _Rows(
        np.array([0, 1, 2, 3, top_key], dtype=np.int32),
        np.array([7, 7 + span, 9, 8, 7], dtype=np.int64),
        np.full(n, 3, dtype=np.int32),
        np.full(n, 41, dtype=np.int64),
        np.arange(0, 2 * n, 2, dtype=np.int32),
        np.linspace(0.5, 2.5, n),
    )
    mixed = _Rows(one.key, one.ts, np.array([3, 3, 4, 3, 3], np.int32), one.seq, one.row, one.value)
    unordered = _Rows(one.key, one.ts, one.gateway, one.seq, one.row[::-1].copy(), one.value)
    for rows in (one, mixed, unordered):
        packed = rows.pack()
        back = _Rows.unpack(packed)
        for name in ("key", "ts", "gateway", "seq", "value"):
            assert np.array_equal(getattr(back, name), getattr(rows, name)), name
        for name in ("key", "ts", "gateway", "seq", "row", "value"):
            assert getattr(back, name).dtype == getattr(rows, name).dtype, name
        assert np.array_equal(np.argsort(back.row), np.argsort(rows.row))
        assert np.array_equal(back.row, rows.row) == (rows is not one)
        assert (isinstance(packed["seq"], int)) == (rows is not mixed)
        assert ("ts_base" in packed) == (rows is not mixed and span < 2**31)
        if rows is one:
            ts_bytes = 2 if span < 2**16 else 4 if span < 2**31 else 8
            key_bytes = 2 if top_key < 2**16 else 4
            size = sum(v.nbytes for v in packed.values() if isinstance(v, memoryview))
            assert size == n * (8 + ts_bytes + key_bytes)


def test_older_packed_rows_still_restore() -> None:
    """Chunks packed before the narrow layout (int32 keys, int32 offsets, row numbers)."""
    from shoal.processors.count import _Rows  # noqa: PLC0415 - the packed layout is tested

    old = {
        "key": np.array([3, 1], "<i4").tobytes(),
        "gateway": 2,
        "seq": 9,
        "row": np.array([4, 7], "<i4").tobytes(),
        "value": np.array([1.5, 2.5]).tobytes(),
        "ts_base": 1_000,
        "ts": np.array([5, 0], "<i4").tobytes(),
    }
    back = _Rows.unpack(old)
    assert back.key.tolist() == [3, 1]
    assert back.ts.tolist() == [1_005, 1_000]
    assert back.row.tolist() == [4, 7]
    assert back.seq.tolist() == [9, 9]
    with pytest.raises(SchemaError):
        _Rows.unpack({**old, "key_dtype": "<i8"})


def test_snapshots_reuse_packed_chunks_and_still_restore_exactly() -> None:
    """A buffered chunk is packed once while it stays buffered; a chunk split by a close is
    packed afresh: every snapshot restores to the state of the combiner that took it."""
    spec = spec_for([{"kind": "count", "n": 5}], lateness_ms=300)
    batches = make_batches(seed=9, gateways=2, batches_per_gateway=12)
    clock = FakeClock()
    builder, combiner = _announced(spec, batches, clock)
    order = sorted(range(len(batches)), key=lambda i: (batches[i].seq, batches[i].gateway_id))
    reused = 0
    for index in order:
        b = batches[index]
        _apply(builder, combiner, b, clock.now_ms())
        combiner.tick()
        assert combiner.counts is not None
        before = {id(c) for c in combiner.counts._pending} & set(combiner.counts._packed)
        reused += len(before)
        snapshot = combiner.snapshot()
        restored = Combiner(spec, 0, clock)
        restored.restore(snapshot)
        assert restored.counts is not None
        assert restored.counts.tail_rows == combiner.counts.tail_rows
        assert restored.counts.buffered_span() == combiner.counts.buffered_span()
        assert restored.counts._pending_rows == sum(len(c) for c in combiner.counts._pending)
        clock.advance(COUNT_CLOSE_INTERVAL_MS)
    assert reused > 0  # chunks were carried from one snapshot to the next
    clock.advance(spec.idle_timeout_ms + 1)
    frames = [c.flush().frame for c in (combiner, restored)]
    assert frames[0].equals(frames[1])


def test_a_snapshot_in_parts_is_the_snapshot_msgpack_packs() -> None:
    """``snapshot_parts`` joined is what ``msgpack.packb`` makes of the snapshot's content,
    and the buffered chunks' values go in as the chunks' own columns, not copies.

    The checkpoint file must stay byte for byte the one ``packb`` wrote, which every restore
    reads; large chunks (values of ``BY_REFERENCE_BYTES`` or more) and small ones (copied),
    chunks packed by an earlier snapshot and chunks split by a close all take part.
    """
    spec = spec_for([{"kind": "count", "n": 50}], lateness_ms=300)
    batches = make_batches(seed=4, gateways=2, batches_per_gateway=8, rows_per_batch=(0, 1_500))
    clock = FakeClock()
    builder, combiner = _announced(spec, batches, clock)
    order = sorted(range(len(batches)), key=lambda i: (batches[i].seq, batches[i].gateway_id))
    referenced = 0
    for index in order:
        _apply(builder, combiner, batches[index], clock.now_ms())
        combiner.tick()
        for _ in range(2):  # the second: chunks kept as packed by the first
            parts = combiner.snapshot_parts()
            joined = b"".join(parts)
            assert joined == msgpack.packb(msgpack.unpackb(joined, raw=False), use_bin_type=True)
            assert combiner.counts is not None
            values = [c.value for c in combiner.counts._pending]
            referenced += sum(
                any(
                    isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), v)
                    for p in parts
                )
                for v in values
            )
        clock.advance(COUNT_CLOSE_INTERVAL_MS)
    assert referenced > 0  # chunks went in by reference
    restored = Combiner(spec, 0, clock)
    restored.restore(combiner.snapshot())
    clock.advance(spec.idle_timeout_ms + 1)
    frames = [c.flush().frame for c in (combiner, restored)]
    assert frames[0].equals(frames[1])


def _settling_everywhere(mp: pytest.MonkeyPatch) -> list[int]:
    """Consolidate batch entries at every step, so settling runs at every step; returns a
    list that grows by the entries each settling counted instead of kept."""
    from shoal.processors import count  # noqa: PLC0415 - the consolidation slack is patched

    settled: list[int] = []
    settle = count._Unfinished._settle

    def counting(self: count._Unfinished, entries: count._Entries) -> count._Entries:
        kept = settle(self, entries)
        settled.append(len(entries) - len(kept))
        return kept

    mp.setattr(count, "ENTRY_SLACK", 0)
    mp.setattr(count._Unfinished, "_settle", counting)
    return settled


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_settled_batches_keep_the_batch_counts_exact(
    partitions: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch entries of batches with no row buffered any more are counted, not kept: the
    ``batches`` of every window still equal the oracle's distinct batches."""
    settled = _settling_everywhere(monkeypatch)
    spec = spec_for([{"kind": "count", "n": 7}, {"kind": "count", "n": 20}], partitions)
    batches = make_batches(seed=partitions * 10 + workers, gateways=3, batches_per_gateway=15)
    emitted, _, _ = check(spec, batches, seed=workers, workers=workers)
    assert emitted.height > 20
    assert sum(settled) > 0  # entries were settled, and the counts stayed exact


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gateways=st.integers(1, 3),
    batches=st.integers(1, 10),
    n=st.sampled_from([1, 2, 3, 10]),
    workers=st.integers(1, 5),
    lateness_ms=st.sampled_from([0, 300, 2_000]),
    duplicate_fraction=st.floats(0.0, 1.0),
)
def test_property_settling_batches_at_every_step(
    seed, gateways, batches, n, workers, lateness_ms, duplicate_fraction
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _settling_everywhere(mp)
        spec = spec_for([{"kind": "count", "n": n}], 1, lateness_ms)
        data = make_batches(
            seed=seed, gateways=gateways, batches_per_gateway=batches, gap_every=3, keys=4
        )
        check(spec, data, seed=seed, workers=workers, duplicate_fraction=duplicate_fraction)


def test_settled_counts_survive_a_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """``settled`` is part of the checkpoint: a combiner restored at every step still counts
    every window's batches exactly."""
    settled = _settling_everywhere(monkeypatch)
    spec = spec_for([{"kind": "count", "n": 9}], lateness_ms=300)
    batches = make_batches(seed=5, gateways=2, batches_per_gateway=12)
    clock = FakeClock()
    # restored now and then: between, entries pile up and settle
    combiner, frames = _feed_restoring(spec, batches, clock, lambda index: index % 3 == 0)
    frames.append(combiner.flush().frame)
    assert sum(settled) > 0
    expected, _, scale = expected_count_results(all_rows(batches), spec, flush=True)
    assert_count_windows_match(pl.concat(frames), expected, spec, scale)


def _announced(
    spec: PipelineSpec, batches: list[GeneratedBatch], clock: FakeClock
) -> tuple[PartialBuilder, Combiner]:
    """A worker's builder and a combiner that has every gateway of ``batches`` announced."""
    builder = PartialBuilder(spec, "w")
    combiner = Combiner(spec, 0, clock)
    for status in statuses_for(batches, clock.now_ms()):
        combiner.receive_status(status)
    return builder, combiner


def _apply(builder: PartialBuilder, combiner: Combiner, b: GeneratedBatch, now_ms: int) -> None:
    """``b``'s partials, through the wire format, into ``combiner``."""
    info = BatchInfo(b.gateway_id, b.seq, "s", 0, None, None, 0, 0, "w")
    for p in builder.build(b.frame, info, now_ms):
        combiner.receive(Partial.decode(p.encode()))


def _feed_restoring(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    clock: FakeClock,
    restore_after: Callable[[int], bool],
) -> tuple[Combiner, list[pl.DataFrame]]:
    """Feed ``batches`` in (seq, gateway) order, a tick after each; after batch ``index``,
    when ``restore_after(index)``, go on in a fresh combiner restored from a snapshot.

    Returns the combiner in use at the end and the frames its ticks closed."""
    builder, combiner = _announced(spec, batches, clock)
    frames = []
    order = sorted(range(len(batches)), key=lambda i: (batches[i].seq, batches[i].gateway_id))
    for index in order:
        b = batches[index]
        _apply(builder, combiner, b, clock.now_ms())
        closed = combiner.tick().closed
        if closed is not None:
            frames.append(closed.frame)
        if restore_after(index):
            fresh = Combiner(spec, 0, clock)
            fresh.restore(combiner.snapshot())
            combiner = fresh
        clock.advance(COUNT_CLOSE_INTERVAL_MS)
    return combiner, frames
