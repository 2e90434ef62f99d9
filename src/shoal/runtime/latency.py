"""Latency histograms with a relative error bound, for every sample of a run.

Log buckets (like the quantile sketch): each sample counts in bucket ``ceil(log_g(ms))`` with
``g = 1.02``, so reported quantiles are within 1 % of the true sample quantiles, in constant
memory however long the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

_GAMMA: Final = 1.02
_LOG_GAMMA: Final = math.log(_GAMMA)
_FLOOR_MS: Final = 0.001
CDF_QUANTILES: Final = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999)
"""Where ``summary()`` samples the distribution for CDF plots (a few numbers per heartbeat)."""


class LatencyHistogram:
    """Counts of latency samples (milliseconds) in 2 %-wide buckets."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.max_ms = 0.0
        self.total_ms = 0.0
        """Sum of the samples (as recorded: the ``_sum`` of a Prometheus histogram)."""

    def add(self, ms: float) -> None:
        """Record one sample (negative clock skew counts as 0)."""
        value = max(ms, _FLOOR_MS)
        key = math.ceil(math.log(value) / _LOG_GAMMA)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.count += 1
        self.max_ms = max(self.max_ms, ms)
        self.total_ms += value

    def merge(self, other: LatencyHistogram) -> None:
        """Add another histogram's samples."""
        for key, n in other.counts.items():
            self.counts[key] = self.counts.get(key, 0) + n
        self.count += other.count
        self.max_ms = max(self.max_ms, other.max_ms)
        self.total_ms += other.total_ms

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile in ms (the bucket's midpoint), None without samples."""
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for key in sorted(self.counts):
            seen += self.counts[key]
            if seen > rank:
                return 2.0 * _GAMMA**key / (_GAMMA + 1.0)
        return self.max_ms

    def cumulative(self, bounds_ms: Sequence[float]) -> list[int]:
        """Samples at or below each bound (ascending bounds): Prometheus ``le`` buckets.

        A 2 %-wide bucket that straddles a bound counts above it, so a count may miss
        samples up to 2 % below the bound.
        """
        keys = sorted(self.counts)
        out: list[int] = []
        seen = 0
        i = 0
        for bound in bounds_ms:
            while i < len(keys) and _GAMMA ** keys[i] <= bound:
                seen += self.counts[keys[i]]
                i += 1
            out.append(seen)
        return out

    def summary(self) -> dict[str, object] | None:
        """p50, p95, p99, max, n and ``cdf`` (None without samples).

        ``cdf`` is ``[[q, ms], ...]`` at ``CDF_QUANTILES``: enough to draw the distribution.
        """
        if not self.count:
            return None
        return {
            "p50": round(self.quantile(0.50) or 0.0, 3),
            "p95": round(self.quantile(0.95) or 0.0, 3),
            "p99": round(self.quantile(0.99) or 0.0, 3),
            "max": round(self.max_ms, 3),
            "n": self.count,
            "cdf": [[q, round(self.quantile(q) or 0.0, 3)] for q in CDF_QUANTILES],
        }
