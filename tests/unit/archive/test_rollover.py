"""Rollover decisions: rows, bytes, age, and the memory budget across partitions."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from shoal.archive.rollover import Buffers, RolloverPolicy
from shoal.errors import ConfigError


def add(buffers: Buffers, folder: Path, rows: int, now_s: float) -> bool:
    chunk = pl.DataFrame({"x": list(range(rows))}, schema={"x": pl.Int64})
    return buffers.add(folder, chunk, rows=rows, size=8 * rows, first_ms=0, now_s=now_s)


def test_rows_threshold() -> None:
    buffers = Buffers(RolloverPolicy(max_rows=10, max_bytes=10**6, max_age_s=60))
    assert not add(buffers, Path("a"), 6, 0)
    assert add(buffers, Path("a"), 4, 0)
    assert buffers.due(0) == [Path("a")]
    part = buffers.take(Path("a"))
    assert part.rows == 10
    assert [c.height for c in part.chunks] == [6, 4]
    assert buffers.bytes == 0
    assert len(buffers) == 0


def test_bytes_threshold() -> None:
    buffers = Buffers(RolloverPolicy(max_rows=10**6, max_bytes=80, max_age_s=60))
    assert not add(buffers, Path("a"), 9, 0)
    assert add(buffers, Path("a"), 1, 0)


def test_age_threshold_counts_from_the_first_row() -> None:
    buffers = Buffers(RolloverPolicy(max_age_s=5))
    add(buffers, Path("a"), 1, 100)
    add(buffers, Path("b"), 1, 103)
    add(buffers, Path("a"), 1, 104)
    assert buffers.due(104.9) == []
    assert buffers.due(105) == [Path("a")]
    assert sorted(buffers.due(108)) == [Path("a"), Path("b")]


def test_budget_rolls_the_largest_partitions_first() -> None:
    policy = RolloverPolicy(max_rows=10**6, max_bytes=800, max_age_s=60, max_buffered_bytes=1_000)
    buffers = Buffers(policy)
    add(buffers, Path("small"), 10, 0)  # 80 bytes
    add(buffers, Path("big"), 60, 0)  # 480
    add(buffers, Path("mid"), 40, 0)  # 320
    assert buffers.due(0) == []  # 880 <= 1000
    add(buffers, Path("small"), 20, 0)  # +160 -> 1040
    assert buffers.due(0) == [Path("big")]
    # bytes being written count too
    assert buffers.due(0, in_flight_bytes=500) == [Path("big"), Path("mid")]


def test_policy_is_validated() -> None:
    with pytest.raises(ConfigError):
        RolloverPolicy(max_rows=0)
    with pytest.raises(ConfigError):
        RolloverPolicy(max_bytes=100, max_buffered_bytes=10)
