"""Load traces (pure): the phases of step, ramp and spike, and traces that cannot run."""

from __future__ import annotations

import pytest

from shoal.errors import TraceError
from shoal.runtime.loadtrace import Phase, Trace, make_trace


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
    with pytest.raises(TraceError, match=message):
        Trace("t", tuple(phases), duration)


def test_unknown_trace() -> None:
    with pytest.raises(TraceError, match="unknown trace"):
        make_trace("sawtooth")
