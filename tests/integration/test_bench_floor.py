"""`shoal bench floor` for real, at a fast pace: it runs, measures every part, reports them.

No assertion on the figures beyond their being measured: timing is what the command reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.errors import UsageError
from shoal.loadtest.bench_floor import Spread
from tests.support.processes import assert_ran, run_shoal

SAMPLES = 8


def test_floor_command_measures_each_part(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    result = run_shoal(
        *("bench", "floor", "--samples", str(SAMPLES), "--period-ms", "20", "--batch", "500"),
        *("--json", str(out)),
        timeout=120,
    )
    assert_ran(result)
    assert "least brokered path" in result.stdout
    record = json.loads(out.read_text())
    assert record["rows"] == 500
    for part in ("wakeup", "hop", "handle_warm", "handle_idle"):
        spread = record[part]
        assert spread["n"] == SAMPLES, part
        assert 0 < spread["min"] <= spread["p50"] <= spread["p95"] <= spread["p99"], part
        assert spread["p99"] <= spread["max"], part
    path = record["one_hop_path_ms"]
    assert path["p50"] == pytest.approx(record["hop"]["p50"] + record["handle_idle"]["p50"])
    assert path["p99_at_least"] <= path["p99_sum"]
    assert record["machine"]["cores_logical"] >= 1


def test_floor_refuses_nonsense() -> None:
    result = run_shoal("bench", "floor", "--samples", "0", timeout=60)
    assert result.returncode != 0
    assert "--samples" in result.stderr


def test_spread_percentiles() -> None:
    spread = Spread.of([float(v) for v in range(1, 101)])
    assert (spread.min, spread.p50, spread.max, spread.n) == (1.0, 50.5, 100.0, 100)
    assert spread.p99 == pytest.approx(99.01)
    with pytest.raises(UsageError, match="no samples"):
        Spread.of([])
