"""The lag a ``bench pipeline`` step ended with: its level over the last samples, not one."""

from __future__ import annotations

from shoal.loadtest.bench_pipeline import LAG_END_SAMPLES, MAX_LAG_SECONDS, StepPeaks


def peaks_of(samples: list[int]) -> StepPeaks:
    peaks = StepPeaks()
    peaks.lags.extend(samples)
    return peaks


def test_a_lag_that_swings_with_the_window_closes_is_judged_by_its_level() -> None:
    offered = 460_000
    # a sliding window's every 1-s step: the lag rises while it closes, falls as it catches up
    swinging = [416_000, 928_000, 336_000, 432_000, 880_000, 416_000, 544_000]
    ended_on_a_crest = 992_000
    assert ended_on_a_crest > MAX_LAG_SECONDS * offered  # one sample alone would fail it
    assert peaks_of(swinging).settled(ended_on_a_crest) == 544_000
    assert peaks_of(swinging).settled(ended_on_a_crest) <= MAX_LAG_SECONDS * offered


def test_a_lag_that_grows_to_the_end_still_fails() -> None:
    offered = 460_000
    growing = [400_000 * (i + 1) for i in range(8)]
    settled = peaks_of(growing).settled(3_600_000)
    assert settled == 3_200_000
    assert settled > MAX_LAG_SECONDS * offered


def test_the_end_is_the_median_of_the_last_samples_and_needs_no_earlier_one() -> None:
    assert LAG_END_SAMPLES == 3
    assert peaks_of([]).settled(7) == 7
    assert peaks_of([10, 1_000, 1]).settled(5) == 5  # median of 1_000, 1, 5
