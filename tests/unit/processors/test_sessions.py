"""Session window arithmetic: a table of boundary cases, and batch pieces merged in any order."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError, UsageError
from shoal.processors._kernels import merge_state, partial_state
from shoal.processors.aggregates import AggregatePlan
from shoal.processors.sessions import SessionRule, _segmented_running_max, _sort_order
from shoal.processors.spec import parse_pipeline

GAP_10 = SessionRule(10)
GAP_10_MAX_100 = SessionRule(10, 100)
TWO_53 = 2**53

# (rule, one key's timestamps, its sessions as (first_ts, last_ts)). Written out by hand: they
# are the contract, not a re-derivation of the rule.
CASES: list[tuple[SessionRule, list[int], list[tuple[int, int]]]] = [
    (GAP_10, [], []),
    (GAP_10, [5], [(5, 5)]),
    # less than gap_ms apart joins; exactly gap_ms apart splits
    (GAP_10, [0, 9], [(0, 9)]),
    (GAP_10, [0, 10], [(0, 0), (10, 10)]),
    (GAP_10, [0, 9, 18, 27], [(0, 27)]),
    (GAP_10, [0, 9, 19, 28], [(0, 9), (19, 28)]),
    # order and duplicates do not matter
    (GAP_10, [27, 0, 18, 9, 9, 0], [(0, 27)]),
    (GAP_10, [3, 3, 3], [(3, 3)]),
    # negative and huge timestamps
    (GAP_10, [-5, 4], [(-5, 4)]),
    (GAP_10, [-10, 0], [(-10, -10), (0, 0)]),
    (GAP_10, [TWO_53 - 1, TWO_53 - 10], [(TWO_53 - 10, TWO_53 - 1)]),
    (GAP_10, [-TWO_53, -TWO_53 + 10], [(-TWO_53, -TWO_53), (-TWO_53 + 10, -TWO_53 + 10)]),
    # the max_duration grid cuts at multiples of 100, whatever the gap
    (GAP_10_MAX_100, [95, 99, 100, 105], [(95, 99), (100, 105)]),
    (GAP_10_MAX_100, [0, 9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99], [(0, 99)]),
    (GAP_10_MAX_100, [91, 99, 108, 117], [(91, 99), (108, 117)]),
    (GAP_10_MAX_100, [-1, 0], [(-1, -1), (0, 0)]),
    (GAP_10_MAX_100, [-100, -91], [(-100, -91)]),
    (GAP_10_MAX_100, [-101, -100], [(-101, -101), (-100, -100)]),
]


@pytest.mark.parametrize(("rule", "timestamps", "expected"), CASES)
def test_sessions_of_table(
    rule: SessionRule, timestamps: list[int], expected: list[tuple[int, int]]
) -> None:
    assert rule.sessions_of(timestamps) == expected


@pytest.mark.parametrize(("rule", "timestamps", "expected"), CASES)
def test_label_rows_and_oracle_table(
    rule: SessionRule, timestamps: list[int], expected: list[tuple[int, int]]
) -> None:
    ts = np.array(timestamps, dtype=np.int64)
    sessions = rule.label_rows(np.zeros(len(ts), dtype=np.int64), ts)
    assert list(zip(sessions.first_ts.tolist(), sessions.last_ts.tolist(), strict=True)) == (
        expected
    )
    for row, label in enumerate(sessions.label.tolist()):
        assert sessions.first_ts[label] <= ts[row] <= sessions.last_ts[label]
    frame = rule.with_sessions(pl.DataFrame({"key": ["k"] * len(ts), "ts": ts}))
    got = frame.select("start", "end").unique().sort("start").rows()
    assert got == [(first, last + rule.gap_ms) for first, last in expected]


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="gap_ms"):
        SessionRule(0)
    with pytest.raises(ConfigError, match="max_duration_ms"):
        SessionRule(10, -5)
    with pytest.raises(UsageError, match="different lengths"):
        GAP_10.label_rows(np.zeros(2, dtype=np.int64), np.zeros(3, dtype=np.int64))


def test_closing_bounds() -> None:
    """A run that is not late starts more than gap_ms after a session that may close."""
    rule, lateness = SessionRule(10), 7
    last = 100
    wm = rule.close_from(last, lateness)
    # the earliest first_ts not late at that watermark
    first = wm - rule.gap_ms - lateness + 1
    assert rule.late_from(first, lateness) > wm
    assert first - last > rule.gap_ms
    assert rule.late_from(first - 1, lateness) == wm
    assert rule.end(last) == 110


# Cases are drawn relative to the gap, on a coarse grid: timestamps are ``i * gap_ms + offset``
# with offsets 0, 1 and gap_ms - 1 most of the time, so rows exactly gap_ms apart (and one
# less, one more) are the common case, not luck. Each batch mixes *runs* (rows of one key at a
# fixed step: below gap_ms makes one long piece, exactly gap_ms a chain of touching pieces)
# with single rows, so a batch's long piece often has another batch's short pieces nested in
# it and a third piece starting past the short one but inside the long one: the case a merge
# that compared with the previous piece's last_ts instead of the running maximum gets wrong.
Batches = list[list[tuple[int, int]]]


@st.composite
def session_cases(draw: st.DrawFn) -> tuple[SessionRule, Batches]:
    """A rule and a few batches of (key, ts) rows built on its gap's grid."""
    gap = draw(st.one_of(st.sampled_from([1, 2, 3, 5, 10]), st.integers(1, 40)))
    max_duration = draw(
        st.one_of(
            st.none(),
            st.integers(1, 12).map(lambda m: m * gap),
            st.integers(1, 150),
        )
    )
    offset = st.one_of(st.sampled_from([0, 1, gap - 1]), st.integers(0, gap - 1))
    position = st.builds(lambda i, o: i * gap + o, st.integers(-4, 16), offset)
    key = st.integers(0, 2)
    single = st.builds(lambda k, t: [(k, t)], key, position)
    step = st.sampled_from(sorted({1, max(1, gap // 2), max(1, gap - 1), gap, gap + 1}))
    run = st.builds(
        lambda k, t, n, d: [(k, t + j * d) for j in range(n)],
        key,
        position,
        st.integers(2, 8),
        step,
    )
    batch = st.lists(st.one_of(single, run), min_size=1, max_size=4).map(
        lambda parts: [row for part in parts for row in part]
    )
    return SessionRule(gap, max_duration), draw(st.lists(batch, min_size=1, max_size=6))


def _oracle(rule: SessionRule, rows: list[tuple[int, int]]) -> set[tuple[int, int, int, int]]:
    """(key, first_ts, last_ts, rows) of every session, from the polars reference."""
    frame = pl.DataFrame(rows, schema={"key": pl.Int64, "ts": pl.Int64}, orient="row")
    grouped = (
        rule.with_sessions(frame)
        .group_by("key", "start")
        .agg(pl.col("ts").max().alias("last"), pl.len().alias("rows"))
    )
    return {
        (k, s, last, n) for k, s, last, n in grouped.select("key", "start", "last", "rows").rows()
    }


@settings(max_examples=300, deadline=None)
@given(case=session_cases(), seed=st.integers(0, 2**32 - 1))
def test_pieces_merge_to_the_oracle_in_any_split_and_order(
    case: tuple[SessionRule, Batches], seed: int
) -> None:
    (rule, batches), rng = case, random.Random(seed)
    rows = [row for batch in batches for row in batch]
    expected = _oracle(rule, rows)
    # the definition agrees with the polars oracle
    for key in {k for k, _ in rows}:
        defined = rule.sessions_of([t for k, t in rows if k == key])
        assert {(f, last) for k, f, last, _ in expected if k == key} == set(defined)
    # each batch's pieces, as a worker computes them (row order within a batch is irrelevant)
    pieces: list[tuple[int, int, int, int]] = []
    for batch in batches:
        shuffled = batch[:]
        rng.shuffle(shuffled)
        key = np.array([k for k, _ in shuffled], dtype=np.int64)
        ts = np.array([t for _, t in shuffled], dtype=np.int64)
        s = rule.label_rows(key, ts)
        counts = np.bincount(s.label, minlength=len(s))
        pieces += zip(
            s.key.tolist(), s.first_ts.tolist(), s.last_ts.tolist(), counts.tolist(), strict=True
        )
    # merged in random groups, then the groups' results merged again (associativity)
    rng.shuffle(pieces)
    for _ in range(3):
        take = rng.randint(0, len(pieces))
        group, rest = pieces[:take], pieces[take:]
        pieces = [*rest, *_merge(rule, group)]
        rng.shuffle(pieces)
    final = _merge(rule, pieces)
    assert set(final) == expected


def _merge(
    rule: SessionRule, pieces: list[tuple[int, int, int, int]]
) -> list[tuple[int, int, int, int]]:
    if not pieces:
        return []
    key, first, last, rows = (np.array(c, dtype=np.int64) for c in zip(*pieces, strict=True))
    s = rule.merge_intervals(key, first, last)
    counts = np.bincount(s.label, weights=rows, minlength=len(s)).astype(np.int64)
    return list(
        zip(s.key.tolist(), s.first_ts.tolist(), s.last_ts.tolist(), counts.tolist(), strict=True)
    )


def test_merge_labels_point_into_their_session() -> None:
    rule = SessionRule(5)
    key = np.array([1, 0, 1, 1, 0], dtype=np.int64)
    first = np.array([20, 0, 0, 8, 30], dtype=np.int64)
    last = np.array([25, 4, 4, 16, 30], dtype=np.int64)
    s = rule.merge_intervals(key, first, last)
    # key 0: [0,4] and [30,30] apart; key 1: [0,4]+[8,16] (8-4 < 5), and [20,25] (20-16 < 5)
    assert list(zip(s.key.tolist(), s.first_ts.tolist(), s.last_ts.tolist(), strict=True)) == [
        (0, 0, 4),
        (0, 30, 30),
        (1, 0, 25),
    ]
    assert s.label.tolist() == [2, 0, 2, 2, 1]


def test_merge_reach_is_the_running_maximum_not_the_previous_piece() -> None:
    """A long piece keeps reaching past shorter pieces that end inside it."""
    rule = SessionRule(5)
    key = np.zeros(3, dtype=np.int64)
    first = np.array([0, 2, 40], dtype=np.int64)
    last = np.array([38, 3, 42], dtype=np.int64)
    s = rule.merge_intervals(key, first, last)
    assert list(zip(s.first_ts.tolist(), s.last_ts.tolist(), strict=True)) == [(0, 42)]


SIMPLE_PLAN = AggregatePlan.for_aggregates(
    parse_pipeline(
        {
            "name": "sessions",
            "windows": [{"size_ms": 1_000}],
            "aggregates": ["count", "sum", "min", "max", "mean", "first", "last"],
        }
    ).aggregates
)


@settings(max_examples=150, deadline=None)
@given(case=session_cases(), seed=st.integers(0, 2**32 - 1))
def test_state_of_pieces_merges_to_the_state_of_the_oracle_sessions(
    case: tuple[SessionRule, Batches], seed: int
) -> None:
    """Steps 2 and 3 in miniature: worker pieces through the registry's kernels, merged."""
    (rule, batches), rng = case, random.Random(seed)
    fields = SIMPLE_PLAN.fields
    rows: list[tuple[int, int]] = []
    values: list[float] = []
    piece_key: list[int] = []
    piece_first: list[int] = []
    piece_last: list[int] = []
    piece_state: list[dict[str, np.ndarray]] = []
    for batch in batches:
        batch_values = [float(rng.randint(-50, 50)) for _ in batch]
        rows += batch
        values += batch_values
        key = np.array([k for k, _ in batch], dtype=np.int64)
        ts = np.array([t for _, t in batch], dtype=np.int64)
        s = rule.label_rows(key, ts)
        groups, state, _ = partial_state(s.label, ts, np.array(batch_values), fields)
        assert groups.tolist() == list(range(len(s)))
        piece_key += s.key.tolist()
        piece_first += s.first_ts.tolist()
        piece_last += s.last_ts.tolist()
        piece_state.append(state)
    columns = {f.name: np.concatenate([p[f.name] for p in piece_state]) for f in fields}
    merged = rule.merge_intervals(
        np.array(piece_key, dtype=np.int64),
        np.array(piece_first, dtype=np.int64),
        np.array(piece_last, dtype=np.int64),
    )
    _, got = merge_state(merged.label, columns, fields)
    # the oracle: the same kernels over all rows, grouped by the polars sessions
    frame = pl.DataFrame({"key": [k for k, _ in rows], "ts": [t for _, t in rows], "value": values})
    oracle = rule.with_sessions(frame).sort("key", "start", "ts", "value")
    session_id = oracle.select(pl.struct("key", "start").rank("dense") - 1).to_series()
    _, want, _ = partial_state(
        session_id.to_numpy().astype(np.int64),
        oracle.get_column("ts").to_numpy(),
        oracle.get_column("value").to_numpy(),
        fields,
    )
    assert (
        merged.first_ts.tolist()
        == oracle.unique(["key", "start"]).sort("key", "start").get_column("start").to_list()
    )
    for name in SIMPLE_PLAN.field_names:
        if name != "batches":
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 5),
            st.integers(-3, 3),
            st.sampled_from([0, 1, 2**40, -(2**40), 2**61]),
            st.integers(-1_000, 1_000),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_the_packed_sort_and_running_max_equal_the_plain_ones(
    rows: list[tuple[int, int, int, int]],
) -> None:
    """Both paths of the merge's helpers (packed int64, and the fallback for huge spans)."""
    key = np.array([r[0] for r in rows], dtype=np.int64)
    cell = np.array([r[1] for r in rows], dtype=np.int64)
    ts = np.array([r[2] + r[3] for r in rows], dtype=np.int64)
    order = _sort_order(key, cell, ts)
    assert np.array_equal(order, np.lexsort((ts, cell, key)))
    segment = np.cumsum(np.r_[True, np.diff(key[order]) != 0]) - 1
    values = ts[order]
    expected = [
        max(v for v, g in zip(values[: i + 1], segment[: i + 1], strict=True) if g == segment[i])
        for i in range(len(values))
    ]
    assert _segmented_running_max(values, segment).tolist() == expected
