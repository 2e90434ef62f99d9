"""``shoal bench memory``: a figure is measured in a fresh process and adds up."""

from __future__ import annotations

import pytest

from shoal._cli.bench_memory import _counts
from shoal.errors import ConfigError
from shoal.loadtest import bench_memory
from shoal.processors.spec import parse_pipeline

SPEC = parse_pipeline(
    {
        "name": "m",
        "windows": [{"kind": "tumbling", "size_ms": 10_000}],
        "aggregates": ["count", "mean", "p50"],
    }
)


def test_combiner_state_grows_with_keys_and_windows_the_worker_keeps_none() -> None:
    one = bench_memory.measure(SPEC, "combiner", 20_000, 1, rows_per_key=1, batch=4_000)
    two = bench_memory.measure(SPEC, "combiner", 20_000, 2, rows_per_key=1, batch=4_000)
    worker = bench_memory.measure(SPEC, "worker", 20_000, 2, rows_per_key=1, batch=4_000)
    # one merged row and one sketch bucket per key and open window
    assert one.state_cells == 2 * 20_000
    assert two.state_cells == 2 * 2 * 20_000
    assert worker.state_cells == 0
    assert one.rows == 20_000
    for figure in (one, two, worker):
        assert 0 < figure.baseline_mb <= figure.rss_mb <= figure.peak_mb
    table = bench_memory.format_table([one, two, worker], (1.0, 2.0, 3.0))
    assert "| combiner | 20,000 | 2 | 40,000 | 80,000 |" in table
    assert "1.00 / 2.00 / 3.00" in table


@pytest.mark.parametrize("text", ["", "0", "a,b", "10,-1"])
def test_counts_are_positive_integers(text: str) -> None:
    with pytest.raises(ConfigError):
        _counts(text)
