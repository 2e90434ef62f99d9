"""``shoal bench pipeline --max``: the search over offered rates, against a model pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import pytest

from shoal.loadtest.bench_pipeline import (
    MIN_BATCH_AGE_MS,
    RESOLUTION,
    PipelineBenchConfig,
    Sealing,
    run_max,
    sealing,
)
from shoal.processors.spec import load_pipeline

SPEC = Path(__file__).parents[3] / "processors" / "default.toml"


Step = Callable[[PipelineBenchConfig, TextIO | None], dict[str, Any]]


def _model(capacity: float, sensors: int = 10_000) -> tuple[Step, list[float]]:
    """A pipeline that sustains any rate up to ``capacity`` meas/s, and records what it ran."""
    rates: list[float] = []

    def step(config: PipelineBenchConfig, progress: TextIO | None) -> dict[str, Any]:
        offered = config.rate * sensors
        rates.append(config.rate)
        return {
            "rate_per_sensor": config.rate,
            "offered_meas_per_s": offered,
            "achieved_meas_per_s": min(offered, capacity),
            "sustained": offered <= capacity,
        }

    return step, rates


@pytest.fixture(scope="module")
def config() -> PipelineBenchConfig:
    return PipelineBenchConfig(spec=load_pipeline(SPEC), spec_source=str(SPEC), rate=25.0)


def test_steps_up_then_bisects_below_the_capacity(config: PipelineBenchConfig) -> None:
    step, rates = _model(capacity=1_000_000)
    found = run_max(config, step=step)
    assert rates[:3] == [25.0, 40.0, 64.0]  # 250k, 400k, 640k sustained; 1.02M not
    assert rates[3] == pytest.approx(102.4)
    assert 640_000 <= found["max_sustained_meas_per_s"] <= 1_000_000
    assert found["best"]["sustained"]


def test_a_first_rate_above_the_capacity_steps_down_instead_of_reporting_nothing(
    config: PipelineBenchConfig,
) -> None:
    step, rates = _model(capacity=100_000)  # the first step offers 250,000
    found = run_max(config, step=step)
    assert rates[:4] == [25.0, 25.0, pytest.approx(15.625), pytest.approx(9.765625)]
    assert 61_000 <= found["max_sustained_meas_per_s"] <= 100_000
    assert found["best"]["sustained"]


def test_nothing_sustained_at_all_reports_zero_after_bounded_steps(
    config: PipelineBenchConfig,
) -> None:
    step, rates = _model(capacity=0)
    found = run_max(config, step=step)
    assert found["max_sustained_meas_per_s"] == 0.0
    assert found["best"] is None
    assert len(rates) == 8  # the first step twice and six down


def test_a_first_step_that_fails_once_is_run_again_and_the_search_steps_up(
    config: PipelineBenchConfig,
) -> None:
    model, rates = _model(capacity=1_000_000)
    stalled = [True]  # the first step ends in a stall: 97 % of what it offered

    def step(step_config: PipelineBenchConfig, progress: TextIO | None) -> dict[str, Any]:
        record = model(step_config, progress)
        if stalled:
            stalled.pop()
            achieved = 0.97 * record["offered_meas_per_s"]
            return {**record, "achieved_meas_per_s": achieved, "sustained": False}
        return record

    found = run_max(config, step=step)
    assert rates[:4] == [25.0, 25.0, 40.0, 64.0]
    assert 640_000 <= found["max_sustained_meas_per_s"] <= 1_000_000


def _at(config: PipelineBenchConfig, **changes: Any) -> Sealing:
    return sealing(replace(config, **changes))


def test_low_rates_over_many_keys_seal_by_age_often_enough_to_read_achieved_to_half_a_percent(
    config: PipelineBenchConfig,
) -> None:
    # The lead's search: 100,000 keys, 10-s steps; ~1,000 meas/s per gateway would take
    # 16 s to fill a 16,000-row batch, longer than the step.
    low = _at(config, sensors_per_gateway=10_000, rate=0.1, duration_s=10.0)
    assert low.sealed_by == "age"
    assert low.fill_ms == pytest.approx(16_000.0)
    assert low.max_delay_ms == 500  # shortened from the configured 1,000
    assert low.span_ms == 500.0
    assert low.resolution == pytest.approx(RESOLUTION)
    record = low.to_dict()
    assert record["staggered"] is True
    assert set(record) >= {"max_delay_ms", "fill_ms", "span_ms", "sealed_by", "resolution"}


def test_high_rates_seal_by_size_and_long_runs_keep_the_configured_batch_age(
    config: PipelineBenchConfig,
) -> None:
    high = _at(config, sensors_per_gateway=1_000, rate=250.0, duration_s=10.0)
    assert (high.sealed_by, high.span_ms) == ("size", 64.0)  # 16,000 rows at 250,000/s
    assert high.resolution < RESOLUTION
    long = _at(config, rate=0.5, duration_s=30.0)
    assert long.max_delay_ms == config.max_delay_ms == 1_000  # never longer than configured
    assert long.resolution <= RESOLUTION


def test_one_gateway_in_short_steps_cannot_reach_the_resolution_and_says_so(
    config: PipelineBenchConfig,
) -> None:
    one = _at(config, scenario="A", rate=0.5, duration_s=10.0)
    assert one.max_delay_ms == MIN_BATCH_AGE_MS
    assert one.resolution == pytest.approx(MIN_BATCH_AGE_MS / 10_000)  # 1 %, reported


def test_every_step_of_a_low_rate_search_is_sealed_for_its_own_rate(
    config: PipelineBenchConfig,
) -> None:
    seen: list[Sealing] = []
    model, rates = _model(capacity=40_000, sensors=100_000)

    def step(step_config: PipelineBenchConfig, progress: TextIO | None) -> dict[str, Any]:
        seen.append(sealing(step_config))
        return model(step_config, progress)

    search = replace(config, sensors_per_gateway=10_000, rate=1.0, duration_s=10.0)
    found = run_max(search, step=step)
    assert 25_000 <= found["max_sustained_meas_per_s"] <= 40_000
    assert len(seen) == len(rates) >= 4
    assert all(s.sealed_by == "age" and s.resolution <= RESOLUTION for s in seen)
    fills = [s.fill_ms for s in seen]
    # the first step runs twice; the step down offers less: batches take longer to fill
    assert fills[2] > fills[1] == fills[0]


def test_full_batches_keep_the_configured_age_and_the_gateways_in_step(
    config: PipelineBenchConfig,
) -> None:
    # `bench matrix`: the research's gateways sent full batches; a 16,000-row batch at
    # 1,000 meas/s per gateway takes 16 s, and the matrix gives it 20 s.
    full = _at(config, rate=1.0, duration_s=10.0, max_delay_ms=20_000, full_batches=True)
    assert (full.max_delay_ms, full.sealed_by, full.staggered) == (20_000, "size", False)
    assert full.resolution == pytest.approx(16_000 / 10_000)  # every gateway's batch at once


def test_batches_that_fill_before_their_age_keep_their_size_in_short_runs(
    config: PipelineBenchConfig,
) -> None:
    # Scenario A at 25/s with 4,000-row batches (the batch-handling benchmark): they fill in
    # 160 ms; a 0.5 % stair of a 10-s run would need 50 ms, but the batch is what is measured.
    sized = _at(config, scenario="A", rate=25.0, batch=4_000, duration_s=10.0)
    assert (sized.max_delay_ms, sized.sealed_by, sized.span_ms) == (1_000, "size", 160.0)
    assert sized.resolution == pytest.approx(0.016)  # reported, not forced
