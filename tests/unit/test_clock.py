"""Injected clocks: the fake one moves by hand; the skewed one is offset, drifts and jumps."""

from __future__ import annotations

import pytest

from shoal.clock import ClockJump, FakeClock, SkewedClock
from shoal.errors import UsageError

T0 = 1_700_000_000_000
HOUR = 3_600_000


def test_a_skewed_clock_is_its_base_plus_offset_and_drift() -> None:
    base = FakeClock(T0)
    clock = SkewedClock(base, offset_ms=HOUR, drift_ppm=100.0)
    assert clock.now_ms() == T0 + HOUR
    base.advance(10_000)
    assert clock.now_ms() == T0 + 10_000 + HOUR + 1  # 100 ppm of 10 s
    assert clock.skew_at(T0 + 1_000_000) == HOUR + 100
    assert clock.monotonic() == base.monotonic() == 10.0
    assert clock.base is base


@pytest.mark.parametrize("by_ms", [HOUR, -HOUR, 1, -1])
def test_a_clock_jump_steps_at_its_time_and_stays(by_ms: int) -> None:
    base = FakeClock(T0)
    clock = SkewedClock(base, offset_ms=-5, jumps=(ClockJump(at_ms=2_000, by_ms=by_ms),))
    base.advance(1_999)
    assert clock.now_ms() == T0 + 1_999 - 5
    base.advance(1)
    assert clock.now_ms() == T0 + 2_000 - 5 + by_ms
    base.advance(60_000)
    assert clock.now_ms() == T0 + 62_000 - 5 + by_ms
    assert clock.monotonic() == 62.0  # timeouts never jump


def test_jumps_add_up_in_their_order_of_time() -> None:
    base = FakeClock(T0)
    jumps = (ClockJump(3_000, -500), ClockJump(1_000, 2_000))
    clock = SkewedClock(base, jumps=jumps)
    assert [clock.skew_at(T0 + t) for t in (0, 999, 1_000, 2_999, 3_000)] == [
        0, 0, 2_000, 2_000, 1_500,
    ]  # fmt: skip


def test_a_jump_before_the_start_is_refused() -> None:
    with pytest.raises(UsageError, match="at or after the start"):
        ClockJump(-1, 10)


def test_the_fake_clock_only_moves_forward() -> None:
    clock = FakeClock(T0)
    clock.advance(5)
    assert clock.now_ms() == T0 + 5
    with pytest.raises(UsageError):
        clock.advance(-1)
