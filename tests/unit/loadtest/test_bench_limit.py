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
