"""The batcher seals by size and by age; time comes from a FakeClock, never a sleep."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.clock import FakeClock
from shoal.errors import ConfigError
from shoal.gateway._batcher import Batcher
from shoal.schemas import DictColumn, Measurements

IDS = ("a", "b", "c")


def block(start: int, n: int) -> Measurements:
    ts = np.arange(start, start + n, dtype=np.int64)
    return Measurements(DictColumn(IDS, (ts % 3).astype(np.uint32)), ts, ts.astype(np.float64))


def rows(batches: list[tuple[Measurements, float]]) -> list[int]:
    return [len(b) for b, _ in batches]


def test_seals_full_batches_by_size_and_keeps_the_rest_in_order() -> None:
    clock = FakeClock()
    batcher = Batcher(batch_size=100, max_delay_ms=1000)
    batcher.add(block(0, 70), clock.monotonic())
    assert batcher.take_full() == []
    batcher.add(block(70, 180), clock.monotonic())
    full = batcher.take_full()
    assert rows(full) == [100, 100]
    assert batcher.rows == 50
    got = np.concatenate([b.ts for b, _ in full] + [b.ts for b, _ in batcher.take_all()])
    np.testing.assert_array_equal(got, np.arange(250))


def test_seals_a_partial_batch_once_its_oldest_row_is_max_delay_old() -> None:
    clock = FakeClock()
    batcher = Batcher(batch_size=100, max_delay_ms=1000)
    batcher.add(block(0, 10), clock.monotonic())
    clock.advance(600)
    batcher.add(block(10, 10), clock.monotonic())
    clock.advance(399)
    assert batcher.take_due(clock.monotonic()) == []
    assert batcher.deadline_s() == pytest.approx(1.0)
    clock.advance(1)
    due = batcher.take_due(clock.monotonic())
    assert rows(due) == [20]
    assert batcher.rows == 0
    assert batcher.deadline_s() is None


def test_the_age_of_a_remainder_is_that_of_its_oldest_row() -> None:
    clock = FakeClock()
    batcher = Batcher(batch_size=100, max_delay_ms=1000)
    batcher.add(block(0, 90), clock.monotonic())  # arrives at t=0
    clock.advance(500)
    batcher.add(block(90, 30), clock.monotonic())  # arrives at t=0.5: 20 rows remain of it
    assert rows(batcher.take_full()) == [100]
    assert batcher.oldest_s == pytest.approx(0.5)
    clock.advance(999)
    assert batcher.take_due(clock.monotonic()) == []
    clock.advance(1)
    assert rows(batcher.take_due(clock.monotonic())) == [20]


def test_take_all_cuts_full_batches_and_one_partial() -> None:
    batcher = Batcher(batch_size=100, max_delay_ms=1000)
    batcher.add(block(0, 230), 0.0)
    assert rows(batcher.take_all()) == [100, 100, 30]


def test_push_front_returns_rows_ahead_of_newer_ones() -> None:
    batcher = Batcher(batch_size=100, max_delay_ms=1000)
    batcher.add(block(50, 10), 1.0)
    batcher.push_front(block(0, 50), 0.0)
    assert batcher.oldest_s == 0.0
    (only, arrived), *_ = batcher.take_all()
    np.testing.assert_array_equal(only.ts, np.r_[np.arange(50), np.arange(50, 60)])
    assert arrived == 0.0


def test_blocks_with_different_dictionaries_are_merged() -> None:
    batcher = Batcher(batch_size=4, max_delay_ms=1000)
    first = Measurements(
        DictColumn(("x", "y"), np.array([0, 1], np.uint32)),
        np.array([1, 2], np.int64),
        np.array([1.0, 2.0]),
        {"unit": DictColumn(("C",), np.array([0, 0], np.uint32))},
    )
    second = Measurements(
        DictColumn(("z", "x"), np.array([0, 1], np.uint32)),
        np.array([3, 4], np.int64),
        np.array([3.0, 4.0]),
    )
    batcher.add(first, 0.0)
    batcher.add(second, 0.0)
    ((joined, _),) = batcher.take_full()
    frame = joined.to_frame()
    assert frame.get_column("sensor_id").to_list() == ["x", "y", "z", "x"]
    assert frame.get_column("unit").to_list() == ["C", "C", None, None]


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ConfigError):
        Batcher(batch_size=0, max_delay_ms=10)
