"""Scaling policies: how many workers a pipeline should have, from what it measures. Pure.

A policy sees ``Signals`` once per tick and returns a ``Decision``; time comes in the signals,
so the policies are deterministic and tested without sleeping.

* ``LagPolicy`` (the default): provision for the arrival rate at a target utilisation of the
  measured per-worker capacity, plus enough extra to drain the backlog within a budget.
  Scale-up is quick (a short stabilisation window), scale-down slow (the largest
  recommendation over a longer window, and a dead band), and every change starts a cooldown.
* ``CpuPolicy``: the research's Micro_s rule: when a worker's core stays above 85 % for 60 s,
  add 4 workers (it never scales down unless told to).
* ``RpsPolicy``: the research's OpenFaaS rule: above 5 batches/s per worker, add workers
  (20 % of the maximum at a time, at most 20), and step back down once one fewer would stay
  under the threshold for a while.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from shoal.errors import ConfigError

PolicyName = Literal["lag", "cpu", "rps"]
POLICIES: Final = ("lag", "cpu", "rps")


@dataclass(frozen=True, slots=True)
class Signals:
    """What the scaler knows at one tick.

    Attributes:
        now_s: monotonic time.
        workers: workers that are up and not draining.
        arrival_rows_per_s: measurements per second the gateways publish (recent).
        batches_per_s: batches per second the gateways publish (recent).
        backlog_rows: measurements published but not yet confirmed (lag).
        oldest_lag_s: age of the oldest unconfirmed batch (None: nothing unconfirmed).
        capacity_rows_per_s: measurements one worker processes per busy second (median of
            the live workers; None until measured).
        worker_cpu_percent: CPU of each live worker, percent of one core.
    """

    now_s: float
    workers: int
    arrival_rows_per_s: float
    batches_per_s: float
    backlog_rows: int
    oldest_lag_s: float | None
    capacity_rows_per_s: float | None
    worker_cpu_percent: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer for one tick."""

    desired: int
    recommendation: int
    reason: str


class Policy(Protocol):
    """A scaling policy (stateful across ticks, time from the signals)."""

    name: str

    def decide(self, signals: Signals) -> Decision:
        """The number of workers wanted now."""
        ...


@dataclass(frozen=True, slots=True)
class Bounds:
    """Worker count limits."""

    min_workers: int = 1
    max_workers: int = 4

    def __post_init__(self) -> None:
        """Refuse impossible bounds."""
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ConfigError(
                f"need 0 <= min ({self.min_workers}) <= max ({self.max_workers}), max >= 1"
            )

    def clamp(self, n: int) -> int:
        """``n`` within the bounds."""
        return max(self.min_workers, min(self.max_workers, n))


# --------------------------------------------------------------------------------------------
# The lag policy


@dataclass(frozen=True, slots=True)
class LagConfig:
    """Tuning of ``LagPolicy``.

    Attributes:
        bounds: min and max workers.
        target_utilization: fraction of a worker's measured capacity to plan for.
        drain_budget_s: a backlog should be gone within this long.
        confirm_delay_s: lag that is not backlog (confirmations trail by a checkpoint).
        default_capacity_rows_per_s: assumed per-worker capacity until one is measured.
        up_window_s: a larger recommendation must hold this long before scaling up.
        down_window_s: scale down only to the largest recommendation of this window.
        down_band: scaling down plans for ``target_utilization * down_band``: a dead band
            between the loads that add a worker and those that remove one, so noise around
            a boundary cannot move the count back and forth.
        cooldown_s: no change sooner than this after the previous one.
    """

    bounds: Bounds = field(default_factory=Bounds)
    target_utilization: float = 0.7
    drain_budget_s: float = 5.0
    confirm_delay_s: float = 1.0
    default_capacity_rows_per_s: float = 500_000.0
    up_window_s: float = 1.0
    down_window_s: float = 30.0
    down_band: float = 0.8
    cooldown_s: float = 5.0


def lag_recommendation(
    signals: Signals, config: LagConfig, utilization: float | None = None
) -> int:
    """Workers needed for the arrival rate plus draining the backlog (monotone in both).

    Plans each worker at ``utilization`` of its measured capacity (default: the target).
    """
    capacity = signals.capacity_rows_per_s or config.default_capacity_rows_per_s
    usable = max(capacity * (utilization or config.target_utilization), 1.0)
    excess = max(0.0, signals.backlog_rows - signals.arrival_rows_per_s * config.confirm_delay_s)
    demand = signals.arrival_rows_per_s + excess / config.drain_budget_s
    return math.ceil(demand / usable - 1e-9) if demand > 0 else 0


class LagPolicy:
    """Capacity planning on lag (see the module docstring).

    Up: when even the smallest recommendation of the last ``up_window_s`` exceeds the
    current count (a sustained need, not one noisy tick). Down: when the largest
    recommendation of a full ``down_window_s``, planned at a lower utilisation (the dead
    band), is below it, straight to that largest one. Any change starts a cooldown.
    """

    name = "lag"

    def __init__(self, config: LagConfig | None = None) -> None:
        self.config = config or LagConfig()
        self._history: deque[tuple[float, int, int]] = deque()
        self._started_s: float | None = None
        self._last_change_s: float | None = None

    def decide(self, signals: Signals) -> Decision:
        """Recommend, stabilise, respect the cooldown."""
        cfg = self.config
        now = signals.now_s
        if self._started_s is None:
            self._started_s = now
        raw = cfg.bounds.clamp(lag_recommendation(signals, cfg))
        low = cfg.target_utilization * cfg.down_band
        raw_down = cfg.bounds.clamp(lag_recommendation(signals, cfg, low))
        self._history.append((now, raw, raw_down))
        while now - self._history[0][0] > cfg.down_window_s:
            self._history.popleft()
        current = signals.workers
        if self._last_change_s is not None and now - self._last_change_s < cfg.cooldown_s:
            return Decision(cfg.bounds.clamp(current), raw, "cooling down")
        sustained_up = min(r for t, r, _ in self._history if now - t <= cfg.up_window_s)
        if sustained_up > current:
            return self._change(now, sustained_up, raw, f"demand needs {sustained_up} workers")
        full_window = now - self._started_s >= cfg.down_window_s
        highest = max(d for _, _, d in self._history)
        if full_window and highest < current:
            return self._change(now, highest, raw, f"demand stayed at or below {highest} workers")
        if current != cfg.bounds.clamp(current):
            return self._change(now, cfg.bounds.clamp(current), raw, "outside the bounds")
        return Decision(current, raw, "hold")

    def _change(self, now: float, desired: int, raw: int, reason: str) -> Decision:
        self._last_change_s = now
        return Decision(self.config.bounds.clamp(desired), raw, reason)


# --------------------------------------------------------------------------------------------
# The research's baselines


@dataclass(frozen=True, slots=True)
class CpuConfig:
    """The research's CPU rule (Micro_s): above ``threshold`` for ``hold_s`` → add ``step``."""

    bounds: Bounds = field(default_factory=lambda: Bounds(1, 20))
    threshold_percent: float = 85.0
    hold_s: float = 60.0
    step: int = 4
    scale_down: bool = False
    down_threshold_percent: float = 30.0


class CpuPolicy:
    """Add workers when a worker's core stays busy (see the module docstring)."""

    name = "cpu"

    def __init__(self, config: CpuConfig | None = None) -> None:
        self.config = config or CpuConfig()
        self._hot_since: float | None = None
        self._cold_since: float | None = None

    def decide(self, signals: Signals) -> Decision:
        """Fire after ``hold_s`` of a hot core; the timer restarts after each change."""
        cfg = self.config
        current = signals.workers
        cpu = signals.worker_cpu_percent
        hot = bool(cpu) and max(cpu) > cfg.threshold_percent
        cold = bool(cpu) and max(cpu) < cfg.down_threshold_percent
        now = signals.now_s
        self._hot_since = (self._hot_since if self._hot_since is not None else now) if hot else None
        self._cold_since = (
            (self._cold_since if self._cold_since is not None else now) if cold else None
        )
        if self._hot_since is not None and now - self._hot_since >= cfg.hold_s:
            self._hot_since = None
            return Decision(
                cfg.bounds.clamp(current + cfg.step),
                current + cfg.step,
                "a core above the threshold for the hold time",
            )
        if cfg.scale_down and self._cold_since is not None and now - self._cold_since >= cfg.hold_s:
            self._cold_since = None
            return Decision(
                cfg.bounds.clamp(current - 1), current - 1, "every core cold for the hold time"
            )
        return Decision(cfg.bounds.clamp(current), current, "hold")


@dataclass(frozen=True, slots=True)
class RpsConfig:
    """The research's OpenFaaS rule: above ``threshold`` batches/s per worker for ``fire_s``."""

    bounds: Bounds = field(default_factory=lambda: Bounds(1, 20))
    threshold_per_worker: float = 5.0
    fire_s: float = 5.0
    resolve_s: float = 30.0
    scale_fraction: float = 0.2


class RpsPolicy:
    """Add workers on request rate (see the module docstring)."""

    name = "rps"

    def __init__(self, config: RpsConfig | None = None) -> None:
        self.config = config or RpsConfig()
        self._firing_since: float | None = None
        self._resolved_since: float | None = None

    def decide(self, signals: Signals) -> Decision:
        """Fire after ``fire_s`` above the threshold; step down after ``resolve_s`` below."""
        cfg = self.config
        current = max(signals.workers, 1)
        now = signals.now_s
        per_worker = signals.batches_per_s / current
        firing = per_worker > cfg.threshold_per_worker
        one_fewer_ok = (
            current > 1 and signals.batches_per_s / (current - 1) <= cfg.threshold_per_worker
        )
        self._firing_since = (
            (self._firing_since if self._firing_since is not None else now) if firing else None
        )
        self._resolved_since = (
            (self._resolved_since if self._resolved_since is not None else now)
            if one_fewer_ok
            else None
        )
        if self._firing_since is not None and now - self._firing_since >= cfg.fire_s:
            self._firing_since = None
            step = max(1, math.ceil(cfg.scale_fraction * cfg.bounds.max_workers))
            return Decision(
                cfg.bounds.clamp(current + step),
                current + step,
                "batches/s per worker above the threshold",
            )
        if self._resolved_since is not None and now - self._resolved_since >= cfg.resolve_s:
            self._resolved_since = None
            return Decision(
                cfg.bounds.clamp(current - 1),
                current - 1,
                "one fewer worker would stay below the threshold",
            )
        return Decision(cfg.bounds.clamp(signals.workers), signals.workers, "hold")


def make_policy(name: str, bounds: Bounds) -> Policy:
    """A policy by name with the given bounds (``lag``, ``cpu`` or ``rps``)."""
    if name == "lag":
        return LagPolicy(LagConfig(bounds=bounds))
    if name == "cpu":
        return CpuPolicy(CpuConfig(bounds=bounds))
    if name == "rps":
        return RpsPolicy(RpsConfig(bounds=bounds))
    raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
