"""``shoal bench pipeline``'s achieved rate is never a silent 0 when heartbeats are missing."""

from __future__ import annotations

import pytest

from shoal.loadtest.bench_pipeline import HEARTBEATS_BASIS, achieved_rate


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
