"""``shoal simulate --stagger``: gateways seal their first batch early, spread over one span."""

from __future__ import annotations

import pytest

from shoal.clock import FakeClock
from shoal.gateway import Gateway, GatewayConfig
from shoal.loadtest.data import synthetic_block
from shoal.loadtest.simulate import SimulationConfig, _Stagger

NOW = 1_700_000_000_000


def test_gateway_i_of_n_seals_its_first_batch_i_over_n_of_a_span_after_the_first_rows() -> None:
    clock = FakeClock(NOW)
    gateways = [
        Gateway(GatewayConfig(f"gw{i}", batch_size=10_000, max_delay_ms=1_000), clock)
        for i in range(4)
    ]
    try:
        for gateway in gateways:
            gateway.add_block(synthetic_block(50, sensors=10, start_ms=NOW - 10_000))
        stagger = _Stagger(gateways, span_s=1.0)
        sealed_at: dict[float, list[int]] = {}
        for now in (100.0, 100.2, 100.26, 100.5, 100.75, 101.0):
            stagger.seal_due(now)
            sealed_at[now] = [g.stats().batches_sealed for g in gateways]
        # Gateway 0 keeps its age; 1, 2, 3 seal once at 0.25, 0.5 and 0.75 s.
        assert sealed_at[100.0] == [0, 0, 0, 0]
        assert sealed_at[100.2] == [0, 0, 0, 0]
        assert sealed_at[100.26] == [0, 1, 0, 0]
        assert sealed_at[100.5] == [0, 1, 1, 0]
        assert sealed_at[101.0] == [0, 1, 1, 1]
        assert [g.stats().rows_sealed for g in gateways] == [0, 50, 50, 50]
    finally:
        for gateway in gateways:
            gateway.close(timeout_s=0)


@pytest.mark.parametrize(
    ("rate_hz", "span_s"),
    [(0.1, 1.0), (25.0, 0.64)],  # 1,000 sensors: filling 16,000 rows takes 160 s, or 0.64 s
)
def test_the_span_is_the_time_to_fill_a_batch_or_its_age_whichever_is_shorter(
    rate_hz: float, span_s: float
) -> None:
    config = SimulationConfig(sensors=1_000, rate_hz=rate_hz, batch_size=16_000)
    assert config.batch_span_s == pytest.approx(span_s)
