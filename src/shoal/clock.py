"""Time, injected: processing code asks a ``Clock`` instead of calling ``time`` directly.

``SystemClock`` is the real one; ``FakeClock`` lets tests move time by hand; ``SkewedClock``
is a bad clock (offset, drift, ``ClockJump`` steps) over another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from shoal.errors import UsageError


class Clock(Protocol):
    """What components need to know about time."""

    def now_ms(self) -> int:
        """Wall-clock time as integer epoch milliseconds (event-time scale)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (for timeouts and rates)."""
        ...


class SystemClock:
    """The machine's clocks."""

    def now_ms(self) -> int:
        """Wall-clock epoch milliseconds."""
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to; wall and monotonic time move together."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._start_ms = start_ms

    def now_ms(self) -> int:
        """The current fake epoch milliseconds."""
        return self._now_ms

    def monotonic(self) -> float:
        """Seconds since the fake clock was created."""
        return (self._now_ms - self._start_ms) / 1000.0

    def advance(self, ms: int) -> None:
        """Move time forward by ``ms`` milliseconds."""
        if ms < 0:
            raise UsageError(f"time only moves forward, not by {ms} ms")
        self._now_ms += ms


@dataclass(frozen=True, slots=True)
class ClockJump:
    """A step in a clock: ``at_ms`` after the clock was made, it moves by ``by_ms``.

    ``by_ms`` > 0 jumps ahead (a gap in event time), < 0 back (timestamps repeat an
    interval already stamped: late data by the per-gateway rule).
    """

    at_ms: int
    by_ms: int

    def __post_init__(self) -> None:
        """A jump happens at or after the clock's start."""
        if self.at_ms < 0:
            raise UsageError(f"a clock jump happens at or after the start, not {self.at_ms} ms")


class SkewedClock:
    """Another clock's time, off by an offset, a drift and jumps (a gateway with a bad clock).

    ``now_ms`` = base + ``skew_at(base)``: ``offset_ms``, plus ``drift_ppm`` millionths of
    the time elapsed since this clock was made, plus every jump whose time has come.
    ``monotonic`` is the base's, untouched (timeouts still work). Simulations use it to
    exercise event time with clocks ahead, behind, drifting and stepping.
    """

    def __init__(
        self,
        base: Clock,
        offset_ms: int = 0,
        drift_ppm: float = 0.0,
        jumps: tuple[ClockJump, ...] = (),
    ) -> None:
        self._base = base
        self.offset_ms = offset_ms
        self.drift_ppm = drift_ppm
        self.jumps = jumps
        self._origin_ms = base.now_ms()

    @property
    def base(self) -> Clock:
        """The clock this one is skewed from (true time, in a simulation)."""
        return self._base

    def skew_at(self, base_ms: int) -> int:
        """How far this clock is ahead of the base (negative: behind) at base time ``base_ms``."""
        elapsed = base_ms - self._origin_ms
        drift = round(elapsed * self.drift_ppm / 1e6)
        jumped = sum(j.by_ms for j in self.jumps if elapsed >= j.at_ms)
        return self.offset_ms + drift + jumped

    def now_ms(self) -> int:
        """The base's epoch milliseconds, skewed."""
        now = self._base.now_ms()
        return now + self.skew_at(now)

    def monotonic(self) -> float:
        """The base's monotonic seconds."""
        return self._base.monotonic()
