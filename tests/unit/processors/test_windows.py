"""Window arithmetic: a table of boundary cases, and the vectorised forms against the scalar one."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.windows import (
    WINDOW_KINDS,
    WindowSpec,
    kind_of,
    window_end,
    window_start,
    window_starts,
    with_window_starts,
)

TUMBLING_1S = WindowSpec("t1s", "tumbling", 1_000, 1_000)
TUMBLING_7 = WindowSpec("t7", "tumbling", 7, 7)
HOPPING_3S_1S = WindowSpec("h3s", "hopping", 3_000, 1_000)
HOPPING_10_5 = WindowSpec("h10", "hopping", 10, 5)
HOPPING_SIZE_IS_SLIDE = WindowSpec("h1s", "hopping", 1_000, 1_000)
HOPPING_64 = WindowSpec("h64", "hopping", 6_400, 100)
SLIDING_3S_1S = WindowSpec("s3s", "sliding", 3_000, 1_000)
SLIDING_5_1 = WindowSpec("s5", "sliding", 5, 1)
COUNT_3 = WindowSpec("c3", "count", 1, 1, count=3)  # lateness: each row its own millisecond

TWO_53 = 2**53  # 9_007_199_254_740_992

# (window, timestamp, every window start containing it, oldest first). Written out by hand:
# these are the contract, not a re-derivation of the formula.
CASES: list[tuple[WindowSpec, int, list[int]]] = [
    # tumbling: edges are inclusive at the start, exclusive at the end
    (TUMBLING_1S, 0, [0]),
    (TUMBLING_1S, 1, [0]),
    (TUMBLING_1S, 999, [0]),
    (TUMBLING_1S, 1_000, [1_000]),
    (TUMBLING_1S, 1_001, [1_000]),
    (TUMBLING_1S, 1_999, [1_000]),
    # negative timestamps fall into the window before zero (floor, not truncation)
    (TUMBLING_1S, -1, [-1_000]),
    (TUMBLING_1S, -999, [-1_000]),
    (TUMBLING_1S, -1_000, [-1_000]),
    (TUMBLING_1S, -1_001, [-2_000]),
    # huge values near 2^53 (the largest timestamp the contract admits is 2^53 - 1)
    (TUMBLING_1S, TWO_53 - 1, [9_007_199_254_740_000]),
    (TUMBLING_1S, TWO_53, [9_007_199_254_740_000]),
    (TUMBLING_1S, 9_007_199_254_740_000, [9_007_199_254_740_000]),
    (TUMBLING_1S, 9_007_199_254_739_999, [9_007_199_254_739_000]),
    (TUMBLING_1S, -TWO_53, [-9_007_199_254_741_000]),
    # an odd size
    (TUMBLING_7, 0, [0]),
    (TUMBLING_7, 6, [0]),
    (TUMBLING_7, 7, [7]),
    (TUMBLING_7, 13, [7]),
    (TUMBLING_7, 14, [14]),
    (TUMBLING_7, -1, [-7]),
    (TUMBLING_7, -7, [-7]),
    (TUMBLING_7, -8, [-14]),
    # hopping: size/slide windows per timestamp, oldest first
    (HOPPING_3S_1S, 0, [-2_000, -1_000, 0]),
    (HOPPING_3S_1S, 999, [-2_000, -1_000, 0]),
    (HOPPING_3S_1S, 1_000, [-1_000, 0, 1_000]),
    (HOPPING_3S_1S, 2_999, [0, 1_000, 2_000]),
    (HOPPING_3S_1S, 3_000, [1_000, 2_000, 3_000]),
    (HOPPING_3S_1S, -1, [-3_000, -2_000, -1_000]),
    (HOPPING_3S_1S, -1_000, [-3_000, -2_000, -1_000]),
    (HOPPING_3S_1S, -1_001, [-4_000, -3_000, -2_000]),
    (
        HOPPING_3S_1S,
        TWO_53 - 1,
        [9_007_199_254_738_000, 9_007_199_254_739_000, 9_007_199_254_740_000],
    ),
    (HOPPING_10_5, 4, [-5, 0]),
    (HOPPING_10_5, 5, [0, 5]),
    (HOPPING_10_5, 9, [0, 5]),
    (HOPPING_10_5, 10, [5, 10]),
    (HOPPING_10_5, -5, [-10, -5]),
    (HOPPING_10_5, -6, [-15, -10]),
    # a sliding window holds rows like a hopping one (which of them are results: TRIGGERS)
    (SLIDING_3S_1S, 0, [-2_000, -1_000, 0]),
    (SLIDING_3S_1S, -1, [-3_000, -2_000, -1_000]),
    (SLIDING_5_1, 7, [3, 4, 5, 6, 7]),
    # a hopping window whose slide equals its size behaves like a tumbling one
    (HOPPING_SIZE_IS_SLIDE, 999, [0]),
    (HOPPING_SIZE_IS_SLIDE, 1_000, [1_000]),
    (HOPPING_SIZE_IS_SLIDE, -1, [-1_000]),
    # count windows: for lateness, each row is the 1 ms window at its timestamp
    (COUNT_3, 0, [0]),
    (COUNT_3, -1, [-1]),
    (COUNT_3, 2**53, [2**53]),
]


@pytest.mark.parametrize(("window", "ts", "starts"), CASES)
def test_window_starts_table(window: WindowSpec, ts: int, starts: list[int]) -> None:
    assert window_starts(ts, window) == starts
    assert window_start(ts, window) == starts[-1]
    for start in starts:
        assert start <= ts < window_end(start, window)


@pytest.mark.parametrize(("window", "ts", "starts"), CASES)
def test_with_window_starts_table(window: WindowSpec, ts: int, starts: list[int]) -> None:
    frame = pl.DataFrame({"ts": [ts]}, schema={"ts": pl.Int64})
    out = with_window_starts(frame, window)
    assert sorted(out["start"].to_list()) == starts
    assert out["start"].dtype == pl.Int64
    assert out["ts"].to_list() == [ts] * len(starts)


@pytest.mark.parametrize(("window", "ts", "starts"), CASES)
def test_assign_table(window: WindowSpec, ts: int, starts: list[int]) -> None:
    windows = kind_of(window).assign(np.array([ts], dtype=np.int64), window).expanded()
    assert windows.per_row == len(starts)
    assert (windows.slot >= 0).all()
    assert sorted(windows.starts(windows.slot).tolist()) == starts


def test_kinds_are_registered_by_name() -> None:
    assert list(WINDOW_KINDS) == ["tumbling", "hopping", "sliding", "count"]
    assert all(kind.name == name for name, kind in WINDOW_KINDS.items())
    assert kind_of(TUMBLING_1S) is WINDOW_KINDS["tumbling"]
    assert kind_of(HOPPING_10_5) is WINDOW_KINDS["hopping"]


@pytest.mark.parametrize(
    ("start", "window", "end"),
    [
        (0, TUMBLING_1S, 1_000),
        (-1_000, TUMBLING_1S, 0),
        (-2_000, HOPPING_3S_1S, 1_000),
        (5, HOPPING_10_5, 15),
        (9_007_199_254_740_000, TUMBLING_1S, 9_007_199_254_741_000),
        (9_007_199_254_740_000, HOPPING_3S_1S, 9_007_199_254_743_000),
    ],
)
def test_window_end(start: int, window: WindowSpec, end: int) -> None:
    assert window_end(start, window) == end


@pytest.mark.parametrize(
    ("window", "overlap"),
    [
        (TUMBLING_1S, 1),
        (TUMBLING_7, 1),
        (HOPPING_SIZE_IS_SLIDE, 1),
        (HOPPING_10_5, 2),
        (HOPPING_3S_1S, 3),
        (HOPPING_64, 64),
    ],
)
def test_overlap_counts(window: WindowSpec, overlap: int) -> None:
    assert window.windows_per_row == overlap
    for ts in (-12_345, -1, 0, 1, 99, 100, 6_399, 6_400, TWO_53 - 1):
        starts = window_starts(ts, window)
        assert len(starts) == overlap
        assert len(set(starts)) == overlap
        assert all(b - a == window.slide_ms for a, b in itertools.pairwise(starts))
    frame = pl.DataFrame({"ts": [0, 1, 2]}, schema={"ts": pl.Int64})
    assert with_window_starts(frame, window).height == 3 * overlap


def test_tumbling_keeps_rows_and_order() -> None:
    frame = pl.DataFrame(
        {"ts": [2_500, -1, 1_000, 999], "value": [1.0, 2.0, 3.0, 4.0]},
        schema={"ts": pl.Int64, "value": pl.Float64},
    )
    out = with_window_starts(frame, TUMBLING_1S)
    assert out.columns == ["ts", "value", "start"]
    assert out["start"].to_list() == [2_000, -1_000, 1_000, 0]
    assert out["value"].to_list() == [1.0, 2.0, 3.0, 4.0]


def test_hopping_repeats_other_columns() -> None:
    frame = pl.DataFrame(
        {"event": [1_500], "key": ["a"]}, schema={"event": pl.Int64, "key": pl.String}
    )
    out = with_window_starts(frame, HOPPING_3S_1S, ts="event")
    assert sorted(out.rows()) == [(1_500, "a", -1_000), (1_500, "a", 0), (1_500, "a", 1_000)]


@pytest.mark.parametrize("window", [TUMBLING_1S, HOPPING_3S_1S])
def test_empty_frame(window: WindowSpec) -> None:
    frame = pl.DataFrame({"ts": []}, schema={"ts": pl.Int64})
    out = with_window_starts(frame, window)
    assert out.height == 0
    assert out.schema == pl.Schema({"ts": pl.Int64, "start": pl.Int64})


KINDS = ["hopping", "sliding"]


@st.composite
def window_specs(draw: st.DrawFn) -> WindowSpec:
    slide = draw(st.one_of(st.integers(1, 10), st.integers(1, 10**6), st.sampled_from([1_000])))
    per_row = draw(st.integers(1, 8))
    kind = "tumbling" if per_row == 1 and draw(st.booleans()) else draw(st.sampled_from(KINDS))
    return WindowSpec("w", kind, slide * per_row, slide)


timestamps = st.one_of(
    st.integers(-(2**53), 2**53),
    st.integers(-5_000, 5_000),
    st.sampled_from([0, -1, 1, 2**53 - 1, -(2**53)]),
)


@settings(max_examples=150, deadline=None)
@given(window=window_specs(), ts=timestamps)
def test_scalar_matches_brute_force(window: WindowSpec, ts: int) -> None:
    """Every aligned window containing ``ts``, found by walking back from ``ts``."""
    first = -((ts - window.size_ms + 1) // -window.slide_ms) * window.slide_ms  # ceil to slide
    expected = list(range(first, ts + 1, window.slide_ms))
    assert window_starts(ts, window) == expected


@settings(max_examples=100, deadline=None)
@given(window=window_specs(), ts=st.lists(timestamps, max_size=30))
def test_vectorised_matches_scalar(window: WindowSpec, ts: list[int]) -> None:
    frame = pl.DataFrame(
        {"ts": ts, "row": list(range(len(ts)))}, schema={"ts": pl.Int64, "row": pl.Int64}
    )
    out = with_window_starts(frame, window)
    got = sorted(zip(out["row"].to_list(), out["start"].to_list(), strict=True))
    expected = sorted(
        (row, start) for row, t in enumerate(ts) for start in window_starts(t, window)
    )
    assert got == expected


@settings(max_examples=100, deadline=None)
@given(window=window_specs(), ts=st.lists(timestamps, min_size=1, max_size=30))
def test_assign_matches_scalar(window: WindowSpec, ts: list[int]) -> None:
    """The hot path's assignment: one pane per row, dense non-negative slots."""
    panes = kind_of(window).assign(np.array(ts, dtype=np.int64), window)
    assert panes.per_row == 1
    assert panes.fan == window.windows_per_row
    windows = panes.expanded()
    per_row = windows.per_row
    assert len(windows.slot) == per_row * len(ts)
    assert windows.slot.min() == 0
    starts = windows.starts(windows.slot).tolist()
    for row, t in enumerate(ts):
        assert sorted(starts[row * per_row : (row + 1) * per_row]) == window_starts(t, window)


# (window, one key's row times, the window starts emitted for that key). Written out by hand.
# A sliding window [end - size, end) is a result iff the key has a row in [end - step, end).
TRIGGERS: list[tuple[WindowSpec, list[int], list[int]]] = [
    # one row: the one window ending in the step after it, not the other two holding it
    (SLIDING_3S_1S, [0], [-2_000]),
    (SLIDING_3S_1S, [999], [-2_000]),
    (SLIDING_3S_1S, [1_000], [-1_000]),
    (SLIDING_3S_1S, [-1], [-3_000]),
    # rows in two steps: one window each; rows in one step: one window
    (SLIDING_3S_1S, [0, 1_500], [-2_000, -1_000]),
    (SLIDING_3S_1S, [100, 200, 900], [-2_000]),
    # a gap longer than the window
    (SLIDING_3S_1S, [0, 10_000], [-2_000, 8_000]),
    # step 1: eKuiper's window (t - size, t] for every distinct row time t
    (SLIDING_5_1, [7], [3]),
    (SLIDING_5_1, [7, 7, 9], [3, 5]),
    (SLIDING_5_1, [-3, 0], [-7, -4]),
    (SLIDING_3S_1S, [TWO_53 - 1], [9_007_199_254_738_000]),
    # the other kinds emit every window holding a row
    (HOPPING_3S_1S, [0], [-2_000, -1_000, 0]),
    (TUMBLING_1S, [5, 1_005], [0, 1_000]),
]


def _groups(window: WindowSpec, ts: list[int]) -> pl.DataFrame:
    frame = pl.DataFrame({"ts": ts}, schema={"ts": pl.Int64})
    return with_window_starts(frame, window).group_by("start").agg(pl.col("ts"))


@pytest.mark.parametrize(("window", "ts", "starts"), TRIGGERS)
def test_emitted_table(window: WindowSpec, ts: list[int], starts: list[int]) -> None:
    kind = kind_of(window)
    groups = _groups(window, ts)
    start = groups["start"].to_numpy()
    last = np.array([max(rows) for rows in groups["ts"].to_list()], dtype=np.int64)
    emitted = kind.emitted(start, last if kind.needs_last_ts else None, window)
    keep = np.ones(len(start), dtype=bool) if emitted is None else emitted
    assert sorted(start[keep].tolist()) == starts


@pytest.mark.parametrize(("window", "ts", "starts"), TRIGGERS)
def test_emitted_reference_table(window: WindowSpec, ts: list[int], starts: list[int]) -> None:
    frame = pl.DataFrame({"ts": ts}, schema={"ts": pl.Int64})
    kind = kind_of(window)
    out = (
        kind.with_window_starts(frame, window)
        .group_by("start")
        .agg(kind.emitted_reference(window).alias("emitted"))
        .filter("emitted")
    )
    assert sorted(out["start"].to_list()) == starts


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 64), ts=st.lists(st.integers(-200, 200), min_size=1, max_size=20))
def test_step_one_is_ekuiper(size: int, ts: list[int]) -> None:
    """With step_ms = 1, one window (t - size, t] per distinct row time t, nothing else."""
    window = WindowSpec("w", "sliding", size, 1)
    kind = kind_of(window)
    groups = _groups(window, ts)
    start = groups["start"].to_numpy()
    last = np.array([max(rows) for rows in groups["ts"].to_list()], dtype=np.int64)
    emitted = kind.emitted(start, last, window)
    assert emitted is not None
    ekuiper = sorted({t - size + 1 for t in ts})
    assert sorted(start[emitted].tolist()) == ekuiper
    for begin in ekuiper:  # and each holds exactly the rows of (t - size, t]
        rows = groups.filter(pl.col("start") == begin)["ts"].to_list()[0]
        assert sorted(rows) == sorted(r for r in ts if begin - 1 < r <= begin + size - 1)
