"""The scaling benchmark's arithmetic (pure): recovery times, scale events, verdicts."""

from __future__ import annotations

from shoal.loadtest.bench_scaling import (
    PolicyRun,
    Sample,
    events_per_change,
    recovery_times,
    ticks_above_target,
    verdicts,
)
from shoal.runtime.loadtrace import Phase, Trace
from shoal.runtime.local import Accounting


def run_with(lags: list[float], events: list[float] = (), workers: list[int] | None = None):
    samples = [
        Sample(
            t_s=float(t),
            phase="B",
            gateways=10,
            offered_per_s=1.0,
            arrival_per_s=1.0,
            workers=(workers or [1] * len(lags))[t],
            desired=1,
            lag_rows=int(lag * 1000),
            lag_s=lag,
            oldest_s=None,
            worker_cpu_max=0.0,
            reason="hold",
        )
        for t, lag in enumerate(lags)
    ]
    return PolicyRun(
        policy="lag",
        samples=samples,
        scale_events=list(events),
        worker_seconds=float(sum(s.workers for s in samples)),
        accounting=Accounting(
            generated=10, applied=10, in_results=10, late=0, deadletters=0, unconfirmed_batches=0
        ),
        apply_p99_ms=None,
        apply_p50_ms=None,
        workers_started=1,
        workers_crashed=0,
        wall_s=1.0,
    )


TRACE = Trace("step", (Phase(0, 1, "A"), Phase(10, 10, "B"), Phase(30, 1, "A")), 40)


def test_recovery_is_when_lag_goes_below_one_second_for_good() -> None:
    lags = [0.1] * 10 + [0.5, 2.0, 3.0, 1.5, 0.4, 0.3, 0.2, 0.2, 0.2, 0.2] + [0.1] * 20
    assert recovery_times(run_with(lags), TRACE) == [4.0]


def test_a_blip_does_not_count_as_recovered_until_lag_holds_below_the_target() -> None:
    lags = [0.1] * 10 + [2.0, 0.5, 0.5, 2.0, 0.5] + [0.2] * 15 + [0.1] * 10
    assert recovery_times(run_with(lags), TRACE) == [4.0]


def test_lag_that_never_rose_recovers_at_once_and_lag_that_never_fell_never() -> None:
    assert recovery_times(run_with([0.2] * 40), TRACE) == [0.0]
    assert recovery_times(run_with([0.2] * 10 + [5.0] * 20 + [0.2] * 10), TRACE) == [None]


def test_lag_that_builds_up_after_the_rise_recovers_when_it_settles_not_before() -> None:
    # Below the target for the first seconds of the step (lag takes time to build), then
    # above it for a while: recovery is the settling time, not 0.
    lags = [0.1] * 10 + [0.2] * 6 + [1.5, 3.0, 6.0, 2.0] + [0.3] * 10 + [0.1] * 10
    run = run_with(lags)
    assert recovery_times(run, TRACE) == [10.0]
    assert ticks_above_target(run, TRACE) == 4


def test_lag_above_the_target_at_the_end_of_the_phase_never_recovered() -> None:
    lags = [0.1] * 10 + [0.2] * 16 + [2.0] + [0.2] * 3 + [0.1] * 10
    assert recovery_times(run_with(lags), TRACE) == [None]


def test_scale_events_are_attributed_to_the_change_of_load_before_them() -> None:
    run = run_with([0.1] * 40, events=[3.0, 11.0, 12.0, 45.0])
    assert events_per_change(run, TRACE) == [1, 2, 1]


def test_verdicts_compare_the_lag_policy_with_the_baselines() -> None:
    lag = run_with([0.1] * 10 + [0.5] * 20 + [0.1] * 10, events=[11.0, 35.0])
    cpu = run_with([0.1] * 10 + [9.0] * 20 + [0.1] * 10, workers=[1] * 15 + [5] * 25)
    cpu.policy = "cpu"
    checks = dict(verdicts([lag, cpu], TRACE))
    assert all(checks.values()), checks
    worse = run_with([0.1] * 10 + [0.5] * 20 + [0.1] * 10, events=[11.0, 12.0, 13.0])
    assert not all(dict(verdicts([worse, cpu], TRACE)).values())
