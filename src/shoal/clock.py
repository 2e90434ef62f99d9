"""Time, injected: processing code asks a ``Clock`` instead of calling ``time`` directly.

``SystemClock`` is the real one; ``FakeClock`` lets tests move time by hand.
"""

from __future__ import annotations

import time
from typing import Protocol


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
            raise ValueError("time only moves forward")
        self._now_ms += ms
