"""Rollover decisions: rows, bytes, age, and the memory budget across partitions."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from shoal.archive.rollover import Buffers, RolloverPolicy
from shoal.errors import ConfigError


def chunk(rows: int) -> pl.DataFrame:
    return pl.DataFrame({"x": list(range(rows))}, schema={"x": pl.Int64})  # 8 bytes a row


def test_rows_threshold() -> None:
    buffers = Buffers(RolloverPolicy(max_rows=10, max_bytes=10**6, max_age_s=60))
    assert not buffers.add(Path("a"), chunk(6), 0, now_s=0)
    assert buffers.add(Path("a"), chunk(4), 0, now_s=0)
    assert buffers.due(0) == [Path("a")]
    part = buffers.take(Path("a"))
    assert part.rows == 10
    assert part.frame()["x"].to_list() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert buffers.bytes == 0
    assert len(buffers) == 0


def test_bytes_threshold() -> None:
    buffers = Buffers(RolloverPolicy(max_rows=10**6, max_bytes=80, max_age_s=60))
    assert not buffers.add(Path("a"), chunk(9), 0, now_s=0)
    assert buffers.add(Path("a"), chunk(1), 0, now_s=0)


def test_age_threshold_counts_from_the_first_row() -> None:
    buffers = Buffers(RolloverPolicy(max_age_s=5))
    buffers.add(Path("a"), chunk(1), 0, now_s=100)
    buffers.add(Path("b"), chunk(1), 0, now_s=103)
    buffers.add(Path("a"), chunk(1), 0, now_s=104)
    assert buffers.due(104.9) == []
    assert buffers.due(105) == [Path("a")]
    assert sorted(buffers.due(108)) == [Path("a"), Path("b")]


def test_budget_rolls_the_largest_partitions_first() -> None:
    policy = RolloverPolicy(max_rows=10**6, max_bytes=800, max_age_s=60, max_buffered_bytes=1_000)
    buffers = Buffers(policy)
    buffers.add(Path("small"), chunk(10), 0, now_s=0)  # 80 bytes
    buffers.add(Path("big"), chunk(60), 0, now_s=0)  # 480
    buffers.add(Path("mid"), chunk(40), 0, now_s=0)  # 320
    assert buffers.due(0) == []  # 880 <= 1000
    buffers.add(Path("small"), chunk(20), 0, now_s=0)  # +160 -> 1040
    assert buffers.due(0) == [Path("big")]
    # bytes being written count too
    assert buffers.due(0, in_flight_bytes=500) == [Path("big"), Path("mid")]


def test_policy_is_validated() -> None:
    with pytest.raises(ConfigError):
        RolloverPolicy(max_rows=0)
    with pytest.raises(ConfigError):
        RolloverPolicy(max_bytes=100, max_buffered_bytes=10)
