"""Time, injected: processing code asks a ``Clock`` instead of calling ``time`` directly.

``SystemClock`` is the real one; ``FakeClock`` lets tests move time by hand.
"""

from __future__ import annotations

import time
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


class SkewedClock:
    """Another clock's time, off by a fixed offset plus a drift (a gateway with a bad clock).

    ``now_ms`` = base + ``offset_ms`` + ``drift_ppm`` millionths of the time elapsed since
    this clock was made; ``monotonic`` is the base's, untouched (timeouts still work).
    Simulations use it to exercise event time with clocks ahead, behind and drifting.
    """

    def __init__(self, base: Clock, offset_ms: int = 0, drift_ppm: float = 0.0) -> None:
        self._base = base
        self.offset_ms = offset_ms
        self.drift_ppm = drift_ppm
        self._origin_ms = base.now_ms()

    def now_ms(self) -> int:
        """The base's epoch milliseconds, skewed."""
        now = self._base.now_ms()
        drift = (now - self._origin_ms) * self.drift_ppm / 1e6
        return now + self.offset_ms + round(drift)

    def monotonic(self) -> float:
        """The base's monotonic seconds."""
        return self._base.monotonic()
