"""Scaling policies: pure, driven tick by tick with synthetic signals (no I/O, no sleeping)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.scaler.policy import (
    Bounds,
    CpuConfig,
    CpuPolicy,
    LagConfig,
    LagPolicy,
    RpsConfig,
    RpsPolicy,
    Signals,
    lag_recommendation,
    make_policy,
)

CAPACITY = 300_000.0


def signals(
    t: float,
    workers: int,
    arrival: float,
    *,
    backlog: int = 0,
    capacity: float | None = CAPACITY,
    batches_per_s: float = 0.0,
    cpu: tuple[float, ...] = (),
) -> Signals:
    return Signals(
        now_s=t,
        workers=workers,
        arrival_rows_per_s=arrival,
        batches_per_s=batches_per_s,
        backlog_rows=backlog,
        oldest_lag_s=None,
        capacity_rows_per_s=capacity,
        worker_cpu_percent=cpu,
    )


def drive(policy, arrivals, *, workers: int = 1, backlog=None, dt: float = 1.0):
    """Feed one signal per tick, applying each decision; returns the worker counts."""
    counts = []
    for i, arrival in enumerate(arrivals):
        lag = 0 if backlog is None else backlog[i]
        decision = policy.decide(signals(i * dt, workers, arrival, backlog=lag))
        workers = decision.desired
        counts.append(workers)
    return counts


def changes(counts: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(counts) if a != b)


# -- the recommendation ----------------------------------------------------------------------


@given(
    arrival=st.floats(0, 5e6),
    more=st.floats(0, 5e6),
    backlog=st.integers(0, 10**8),
    extra=st.integers(0, 10**8),
    capacity=st.floats(1e3, 1e7),
)
def test_recommendation_is_monotone_in_arrival_and_backlog(
    arrival, more, backlog, extra, capacity
) -> None:
    config = LagConfig()
    base = lag_recommendation(signals(0, 1, arrival, backlog=backlog, capacity=capacity), config)
    higher_rate = lag_recommendation(
        signals(0, 1, arrival + more, backlog=backlog, capacity=capacity), config
    )
    bigger_backlog = lag_recommendation(
        signals(0, 1, arrival, backlog=backlog + extra, capacity=capacity), config
    )
    assert higher_rate >= base
    assert bigger_backlog >= base


@given(arrival=st.floats(1, 5e6), capacity=st.floats(1e3, 1e7))
def test_recommendation_plans_for_the_target_utilisation(arrival, capacity) -> None:
    config = LagConfig()
    n = lag_recommendation(signals(0, 1, arrival, capacity=capacity), config)
    usable = capacity * config.target_utilization
    assert n * usable >= arrival * (1 - 1e-9)  # enough workers ...
    assert (n - 1) * usable < arrival  # ... and not one more than needed


def test_backlog_beyond_the_confirmation_delay_is_drained_within_the_budget() -> None:
    config = LagConfig(drain_budget_s=5.0, confirm_delay_s=1.0)
    # 100k/s arriving: 100k of lag is just the confirmation delay, not backlog.
    assert lag_recommendation(signals(0, 1, 100_000, backlog=100_000), config) == 1
    # 2.1M of lag: 2M to drain in 5 s = 400k/s more -> 500k/s over 210k/s usable = 3.
    assert lag_recommendation(signals(0, 1, 100_000, backlog=2_100_000), config) == 3


def test_unmeasured_capacity_falls_back_to_the_configured_guess() -> None:
    config = LagConfig(default_capacity_rows_per_s=100_000, target_utilization=0.5)
    assert lag_recommendation(signals(0, 1, 120_000, capacity=None), config) == 3


def test_no_load_needs_no_workers_but_the_bounds_keep_the_minimum() -> None:
    policy = LagPolicy(LagConfig(bounds=Bounds(1, 4)))
    assert lag_recommendation(signals(0, 1, 0.0), policy.config) == 0
    assert drive(policy, [0.0] * 60, workers=1) == [1] * 60


# -- the lag policy over time ------------------------------------------------------------------


def test_a_step_up_scales_at_once_and_in_one_event() -> None:
    policy = LagPolicy(LagConfig(bounds=Bounds(1, 8)))
    counts = drive(policy, [25_000] * 20 + [600_000] * 40, workers=1)
    assert counts[19] == 1
    want = math.ceil(600_000 / (CAPACITY * policy.config.target_utilization))
    first = counts.index(want)
    assert first - 20 <= 2  # within two ticks of the step
    assert changes(counts) == 1


def test_scale_down_waits_for_a_full_quiet_window_then_goes_straight_down() -> None:
    config = LagConfig(bounds=Bounds(1, 8), down_window_s=30.0)
    policy = LagPolicy(config)
    counts = drive(policy, [25_000] * 40 + [600_000] * 40 + [25_000] * 80, workers=1)
    up = counts[79]
    assert up > 1
    # Not before the window has passed since the load fell ...
    assert all(c == up for c in counts[80 : 80 + int(config.down_window_s)])
    # ... then in one step to what the whole window needed.
    assert counts[-1] == 1
    assert changes(counts) == 2


@settings(max_examples=40, deadline=None)
@given(
    level=st.floats(50_000, 1_500_000),
    noise=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**32 - 1),
)
def test_no_flapping_on_noisy_steady_load(level, noise, seed) -> None:
    """Steady load with up to +-30 % noise per tick: one move to the right size, then still."""
    rng = np.random.default_rng(seed)
    arrivals = level * (1 + rng.uniform(-noise, noise, 600))
    backlog = rng.integers(0, int(level), 600)  # lag that is just the confirmation delay
    policy = LagPolicy(LagConfig(bounds=Bounds(1, 16)))
    counts = drive(policy, arrivals, workers=1, backlog=backlog)
    # After the first minute: at most two moves (noise peaks may justify one more worker) ...
    assert changes(counts[60:]) <= 2
    # ... and never back and forth: every move goes the same way.
    moves = [b - a for a, b in zip([1, *counts], counts, strict=False) if a != b]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves)


@settings(max_examples=40, deadline=None)
@given(levels=st.lists(st.floats(0, 2_000_000), min_size=2, max_size=6))
def test_more_load_never_gets_fewer_workers(levels) -> None:
    """Monotone response: for piecewise-constant load, the settled count rises with the load."""
    settled = []
    for level in sorted(levels):
        policy = LagPolicy(LagConfig(bounds=Bounds(1, 32)))
        settled.append(drive(policy, [level] * 90, workers=1)[-1])
    assert settled == sorted(settled)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.floats(0, 1e7), min_size=1, max_size=80),
    low=st.integers(0, 3),
    span=st.integers(0, 6),
)
def test_every_decision_is_within_the_bounds(arrivals, low, span) -> None:
    bounds = Bounds(low, max(1, low + span))
    for policy in (
        LagPolicy(LagConfig(bounds=bounds)),
        CpuPolicy(CpuConfig(bounds=bounds)),
        RpsPolicy(RpsConfig(bounds=bounds)),
    ):
        workers = bounds.max_workers
        for i, arrival in enumerate(arrivals):
            decision = policy.decide(
                signals(i * 7.0, workers, arrival, batches_per_s=arrival / 1e4, cpu=(99.0,))
            )
            assert bounds.min_workers <= decision.desired <= bounds.max_workers
            workers = decision.desired


def test_cooldown_holds_after_a_change() -> None:
    config = LagConfig(bounds=Bounds(1, 8), cooldown_s=5.0)
    policy = LagPolicy(config)
    policy.decide(signals(0, 1, 0))
    assert policy.decide(signals(1, 1, 600_000)).desired == 1  # not sustained yet
    first = policy.decide(signals(2, 1, 600_000))
    assert first.desired > 1
    # A much bigger need right after: held until the cooldown ends.
    held = policy.decide(signals(3, first.desired, 3_000_000))
    assert held.desired == first.desired
    assert held.reason == "cooling down"


# -- the research's baselines ------------------------------------------------------------------


def test_cpu_rule_adds_four_after_sixty_seconds_of_a_hot_core() -> None:
    policy = CpuPolicy(CpuConfig(bounds=Bounds(1, 20)))
    workers = 1
    history = []
    for t in range(130):
        workers = policy.decide(signals(t, workers, 0, cpu=(95.0,))).desired
        history.append(workers)
    assert history[59] == 1
    assert history[60] == 5
    assert history[120] == 5  # the timer restarts after each change ...
    assert history[121] == 9  # ... so the next 60 s end one tick later
    assert changes(history) == 2


def test_cpu_rule_resets_when_the_core_cools_and_never_scales_down_by_default() -> None:
    policy = CpuPolicy()
    workers = 5
    for t in range(200):
        cpu = (95.0,) if t % 50 < 40 else (10.0,)  # never hot for 60 s in a row
        workers = policy.decide(signals(t, workers, 0, cpu=(*cpu, 5.0))).desired
    assert workers == 5


def test_rps_rule_fires_after_five_seconds_above_five_batches_per_worker() -> None:
    policy = RpsPolicy(RpsConfig(bounds=Bounds(1, 20)))
    workers = 1
    history = []
    for t in range(12):
        workers = policy.decide(signals(t, workers, 0, batches_per_s=16.0)).desired
        history.append(workers)
    assert history[4] == 1
    assert history[5] == 5  # + 20 % of the maximum of 20


def test_rps_rule_steps_down_when_one_fewer_would_do() -> None:
    policy = RpsPolicy(RpsConfig(bounds=Bounds(1, 20), resolve_s=30.0))
    workers = 5
    for t in range(200):
        workers = policy.decide(signals(t, workers, 0, batches_per_s=6.0)).desired
    assert workers == 2  # 6 / 2 = 3 <= 5; 6 / 1 = 6 > 5


def test_make_policy_knows_its_names() -> None:
    assert make_policy("lag", Bounds()).name == "lag"
    assert make_policy("cpu", Bounds()).name == "cpu"
    assert make_policy("rps", Bounds()).name == "rps"
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("magic", Bounds())


def test_bounds_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="min"):
        Bounds(3, 2)
    with pytest.raises(ConfigError, match="max >= 1"):
        Bounds(0, 0)
    assert Bounds(1, 4).clamp(9) == 4
    assert Bounds(2, 4).clamp(0) == 2
