"""``shoal bench pipeline --max``: the search over offered rates, against a model pipeline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import pytest

from shoal.loadtest.bench_pipeline import PipelineBenchConfig, run_max
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
    assert rates[:3] == [25.0, pytest.approx(15.625), pytest.approx(9.765625)]
    assert 61_000 <= found["max_sustained_meas_per_s"] <= 100_000
    assert found["best"]["sustained"]


def test_nothing_sustained_at_all_reports_zero_after_bounded_steps(
    config: PipelineBenchConfig,
) -> None:
    step, rates = _model(capacity=0)
    found = run_max(config, step=step)
    assert found["max_sustained_meas_per_s"] == 0.0
    assert found["best"] is None
    assert len(rates) == 7  # the first step and six down
