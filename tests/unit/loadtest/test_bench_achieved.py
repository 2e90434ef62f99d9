"""``shoal bench pipeline``'s achieved rate is never a silent 0 when heartbeats are missing."""

from __future__ import annotations

import pytest

from shoal.loadtest.bench_pipeline import HEARTBEATS_BASIS, achieved_rate, fitted_rate


def test_two_heartbeats_give_the_rate_on_the_combiners_clock() -> None:
    rate, basis = achieved_rate((1_000, 500), (11_000, 100_500), applied=0, run_s=1.0)
    assert rate == pytest.approx(10_000.0)
    assert basis == HEARTBEATS_BASIS


@pytest.mark.parametrize(
    ("first", "last", "why"),
    [
        ((5_000, 700), (5_000, 700), "during the measured window"),  # the same heartbeat twice
        ((0, 0), (0, 0), "no combiner heartbeat received"),  # none at all
        ((0, 0), (9_000, 400), "during the measured window"),  # none when the window began
    ],
)
def test_without_two_heartbeats_the_whole_run_is_measured_and_said(
    first: tuple[int, int], last: tuple[int, int], why: str
) -> None:
    rate, basis = achieved_rate(first, last, applied=600_000, run_s=60.0)
    assert rate == pytest.approx(10_000.0)
    assert basis.startswith("whole run, a lower bound")
    assert why in basis


def test_the_slope_over_every_heartbeat_reads_through_a_pause_at_the_last_one() -> None:
    # 15,000/s for 10 s, one heartbeat a second; just before the last one the combiner paused
    # (a window of 100,000 keys closing) and 6,000 rows were still in flight.
    marks = [(1_000 + 1_000 * s, 15_000 * s) for s in range(11)]
    marks[-1] = (marks[-1][0], marks[-1][1] - 6_000)
    ends, _ = achieved_rate(marks[0], marks[-1], applied=0, run_s=1.0)
    fitted, basis = achieved_rate(marks[0], marks[-1], applied=0, run_s=1.0, marks=marks)
    assert ends == pytest.approx(14_400.0)  # 96 %: "not sustained"
    assert fitted == pytest.approx(15_000.0, rel=0.02)
    assert fitted == pytest.approx(fitted_rate(marks))
    assert basis == HEARTBEATS_BASIS


def test_fewer_than_three_distinct_heartbeats_fall_back_to_the_two_ends() -> None:
    marks = [(1_000, 0), (1_000, 0), (11_000, 100_000), (11_000, 100_000)]
    assert fitted_rate(marks) is None
    rate, basis = achieved_rate(marks[0], marks[-1], applied=0, run_s=1.0, marks=marks)
    assert rate == pytest.approx(10_000.0)
    assert basis == HEARTBEATS_BASIS
