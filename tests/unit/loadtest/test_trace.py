"""Load traces and the scaling benchmark's arithmetic (pure)."""

from __future__ import annotations

import pytest

from shoal.loadtest.bench_scaling import (
    PolicyRun,
    Sample,
    events_per_change,
    recovery_times,
    ticks_above_target,
    verdicts,
)
from shoal.loadtest.trace import Phase, Trace, make_trace
from shoal.runtime.local import Accounting


def test_step_is_a_then_b_then_a() -> None:
    trace = make_trace("step", warmup_s=30, high_s=90, cooldown_s=60)
    assert [(p.at_s, p.gateways, p.label) for p in trace.phases] == [
        (0.0, 1, "A"),
        (30.0, 10, "B"),
        (120.0, 1, "A"),
    ]
    assert trace.duration_s == 180
    assert trace.steps_up() == [30.0]
    assert trace.phase_at(29.9).gateways == 1
    assert trace.phase_at(30.0).gateways == 10
    assert trace.phase_at(500).gateways == 1


def test_ramp_rises_and_falls_through_the_levels_between_a_and_b() -> None:
    trace = make_trace("ramp")
    counts = [p.gateways for p in trace.phases]
    peak = counts.index(10)
    assert counts[0] == 1
    assert counts[-1] == 1
    assert counts[: peak + 1] == sorted(counts[: peak + 1])
    assert counts[peak:] == sorted(counts[peak:], reverse=True)
    assert len(set(counts)) >= 4


def test_spike_is_short() -> None:
    spike = make_trace("spike", high_s=90)
    step = make_trace("step", high_s=90)
    burst = spike.phases[2].at_s - spike.phases[1].at_s
    assert 5 <= burst < step.phases[2].at_s - step.phases[1].at_s


def test_scaling_a_trace_keeps_its_shape() -> None:
    trace = make_trace("step").scaled(0.5)
    assert trace.duration_s == make_trace("step").duration_s / 2
    assert [p.gateways for p in trace.phases] == [1, 10, 1]


@pytest.mark.parametrize(
    ("phases", "duration", "message"),
    [
        ((), 10, "starts with a phase at 0"),
        ((Phase(1, 1, "A"),), 10, "starts with a phase at 0"),
        ((Phase(0, 1, "A"), Phase(0, 2, "B")), 10, "increasing"),
        ((Phase(0, 1, "A"), Phase(5, 2, "B")), 5, "end after"),
        ((Phase(0, 0, "A"),), 5, "at least one gateway"),
    ],
)
def test_impossible_traces_are_refused(phases, duration, message) -> None:
    with pytest.raises(ValueError, match=message):
        Trace("t", tuple(phases), duration)


def test_unknown_trace() -> None:
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("sawtooth")


# -- figures of a run ----------------------------------------------------------------------------


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
