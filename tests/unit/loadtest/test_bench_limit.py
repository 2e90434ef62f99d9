"""``compute_limit``: measurements per CPU second of decoding and aggregating the run's batches."""

from __future__ import annotations

import pytest

from shoal.errors import ConfigError
from shoal.loadtest.bench_limit import compute_limit
from shoal.processors.spec import parse_pipeline

SPEC = parse_pipeline(
    {"name": "limit", "aggregates": ["count", "mean", "p95"], "windows": [{"size_ms": 10_000}]}
)


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_the_limit_is_a_positive_rate_for_every_encoding(encoding: str) -> None:
    rate = compute_limit(
        SPEC, batch=500, encoding=encoding, sensors=100, rate_hz=10.0, min_cpu_s=0.05
    )
    assert rate > 0


def test_an_unknown_encoding_is_refused() -> None:
    with pytest.raises((ConfigError, ValueError)):
        compute_limit(SPEC, batch=500, encoding="nope", sensors=100, rate_hz=10.0, min_cpu_s=0.05)


def test_a_slow_field_whose_batches_span_more_than_max_future_ms_is_measured() -> None:
    # 1,000-row batches of 100 sensors at 0.5/s: 20 s of event time each, 640 s for the 32
    # batches, more than the default max_future_ms (300 s) past the first batch. Decoded on
    # one fixed clock, the later ones were "too far in the future" (`--max` stopped at
    # ~9,500 meas/s with 100,000 keys): each is decoded as it is sealed.
    assert SPEC.limits.max_future_ms is not None
    span_ms = 32 * 1_000 / (100 * 0.5) * 1_000
    assert span_ms > SPEC.limits.max_future_ms + 60_000
    rate = compute_limit(
        SPEC, batch=1_000, encoding="binary", sensors=100, rate_hz=0.5, min_cpu_s=0.02
    )
    assert rate > 0
