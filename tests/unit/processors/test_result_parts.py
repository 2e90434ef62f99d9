"""Splitting a window result into parts: deterministic, lossless, every part fits."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.result_parts import (
    _in_key_order,
    json_body_size,
    msgpack_body_size,
    split_result,
)
from shoal.processors.results import (
    Emission,
    WindowResult,
    json_rows,
    ndjson_rows,
    window_json,
    window_msgpack,
)
from shoal.schemas.results import parse_window_message

CTX = Emission("p", 0, 1, 123, 456)


def _result(keys: int, seed: int = 0) -> WindowResult:
    """The same rows for any ``seed``; ``seed`` only shuffles their order."""
    rng = np.random.default_rng(keys)
    frame = pl.DataFrame(
        {
            "key": [f"gw{i % 7:02d}-s{i:05d}" for i in range(keys)],
            "rows": rng.integers(1, 100, keys),
            "batches": rng.integers(1, 5, keys),
            "mean": rng.normal(size=keys),
        }
    )
    return WindowResult(
        "tumbling-10s", 1_000, 11_000, frame.sample(fraction=1.0, shuffle=True, seed=seed)
    )


@pytest.mark.parametrize("measure", [json_body_size, msgpack_body_size])
def test_a_result_that_fits_is_returned_unchanged(measure) -> None:  # type: ignore[no-untyped-def]
    result = _result(50)
    split = split_result(result, measure(result.frame), measure)
    assert split.parts == [result] or split.parts[0] is result
    assert split.oversized == []
    assert split_result(result, None, measure).parts[0] is result


@pytest.mark.parametrize(
    ("measure", "encode"), [(json_body_size, window_json), (msgpack_body_size, window_msgpack)]
)
def test_a_large_result_splits_losslessly_and_each_part_fits(measure, encode) -> None:  # type: ignore[no-untyped-def]
    result = _result(3_000)
    budget = measure(result.frame) // 5
    split = split_result(result, budget, measure)
    assert len(split.parts) >= 5
    assert [p.part for p in split.parts] == list(range(len(split.parts)))
    assert {p.parts for p in split.parts} == {len(split.parts)}
    for part in split.parts:
        assert measure(part.frame) <= budget
    whole = pl.concat([p.frame for p in split.parts])
    assert whole.sort("key").equals(result.frame.sort("key"))
    # every part is a self-describing window message
    messages = [parse_window_message(encode(p, CTX)) for p in split.parts]
    assert [(m.part, m.parts) for m in messages] == [(p.part, p.parts) for p in split.parts]
    assert sum(m.rows for m in messages) == result.rows


def test_the_split_is_deterministic_whatever_the_row_order() -> None:
    a, b = _result(2_000, seed=1), _result(2_000, seed=2)
    assert not a.frame.equals(b.frame)  # same rows, other order
    assert a.frame.sort("key").equals(b.frame.sort("key"))
    budget = json_body_size(a.frame) // 3
    parts_a = split_result(a, budget).parts
    parts_b = split_result(b, budget).parts
    assert len(parts_a) == len(parts_b)
    for x, y in zip(parts_a, parts_b, strict=True):
        assert x.frame.equals(y.frame)


def test_a_row_no_message_can_carry_is_taken_out_not_retried() -> None:
    result = _result(100)
    frame = result.frame.with_columns(
        pl.when(pl.col("key") == "gw03-s00010")
        .then(pl.lit("x" * 5_000))
        .otherwise(pl.col("key"))
        .alias("key")
    )
    big = WindowResult(result.window, result.start, result.end, frame)
    split = split_result(big, 2_000)
    assert [o.key for o in split.oversized] == ["x" * 5_000]
    assert split.oversized[0].size > 2_000
    kept = pl.concat([p.frame for p in split.parts])
    assert kept.height == 99
    assert all(json_body_size(p.frame) <= 2_000 for p in split.parts)


def test_only_oversized_rows_leave_nothing_to_publish() -> None:
    frame = pl.DataFrame({"key": ["a" * 500], "rows": [1], "batches": [1]})
    split = split_result(WindowResult("w", 0, 10, frame), 100)
    assert split.parts == []
    assert len(split.oversized) == 1


@settings(max_examples=30, deadline=None)
@given(keys=st.integers(1, 400), divisor=st.integers(2, 40))
def test_split_property(keys: int, divisor: int) -> None:
    result = _result(keys, seed=keys)
    budget = max(200, json_body_size(result.frame) // divisor)  # above any one row
    split = split_result(result, budget)
    assert split.oversized == []
    assert sum(p.frame.height for p in split.parts) == keys
    assert all(json_body_size(p.frame) <= budget for p in split.parts)
    again = split_result(_result(keys, seed=keys + 1), budget)
    assert [p.frame["key"].to_list() for p in again.parts] == [
        p.frame["key"].to_list() for p in split.parts
    ]


@settings(max_examples=30, deadline=None)
@given(
    keys=st.integers(1, 300),
    divisor=st.integers(1, 30),
    big=st.integers(-1, 299),
    in_key_order=st.booleans(),
)
def test_a_split_from_encoded_lines_equals_the_split_of_the_frame(
    keys: int, divisor: int, big: int, in_key_order: bool
) -> None:
    """The combiner splits from the rows it encoded once (``lines``): the same parts, rows
    taken out and bytes, without encoding each part again; rows already in key order (a
    combiner's frame can be) are cut where they are."""
    result = _result(keys, seed=keys)
    if in_key_order:
        result = WindowResult(result.window, result.start, result.end, result.frame.sort("key"))
    if 0 <= big < keys:  # a row no message can carry, sometimes
        frame = result.frame.with_columns(
            pl.when(pl.int_range(pl.len()) == big)
            .then(pl.lit("x" * 3_000))
            .otherwise(pl.col("key"))
            .alias("key")
        )
        result = WindowResult(result.window, result.start, result.end, frame)
    budget = max(250, json_body_size(result.frame) // divisor)
    lines = ndjson_rows(result).splitlines()
    by_frame = split_result(result, budget)
    by_lines = split_result(result, budget, lines=lines)
    assert [o.key for o in by_lines.oversized] == [o.key for o in by_frame.oversized]
    assert [o.size for o in by_lines.oversized] == [o.size for o in by_frame.oversized]
    assert [(p.part, p.parts) for p in by_lines.parts] == [
        (p.part, p.parts) for p in by_frame.parts
    ]
    for got, want in zip(by_lines.parts, by_frame.parts, strict=True):
        assert got.frame.equals(want.frame)
    if by_lines.bodies is None and not by_lines.oversized:  # fits whole: the caller's rows
        assert by_lines.parts == [result]
    elif by_lines.bodies is None:  # every row too large for any message: nothing else to send
        assert by_lines.parts == []
        assert len(by_lines.oversized) == result.frame.height
    else:
        assert by_lines.bodies == [json_rows(p) for p in by_frame.parts]


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.text(max_size=8), min_size=1, max_size=40, unique=True))
def test_rows_in_key_order_are_recognised_as_polars_sorts_them(keys: list[str]) -> None:
    """Any text (non-ASCII too): the check agrees with polars' sort, the order parts keep."""
    frame = pl.DataFrame({"key": keys})
    assert _in_key_order(frame) == frame["key"].equals(frame.sort("key")["key"])
    assert _in_key_order(frame.sort("key"))
    assert not _in_key_order(pl.DataFrame({"key": [None, *keys]}, schema={"key": pl.String}))
