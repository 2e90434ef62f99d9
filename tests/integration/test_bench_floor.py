"""`shoal bench floor` for real, at a fast pace: it runs, measures every part, reports them.

No assertion on the figures beyond their being measured: timing is what the command reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.loadtest.bench_floor import Spread

SAMPLES = 8


def test_floor_command_measures_each_part(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.cli",
            "bench",
            "floor",
            "--samples",
            str(SAMPLES),
            "--period-ms",
            "20",
            "--batch",
            "500",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
    result = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "bench", "floor", "--samples", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "--samples" in result.stderr


def test_spread_percentiles() -> None:
    spread = Spread.of([float(v) for v in range(1, 101)])
    assert (spread.min, spread.p50, spread.max, spread.n) == (1.0, 50.5, 100.0, 100)
    assert spread.p99 == pytest.approx(99.01)
    with pytest.raises(ValueError, match="no samples"):
        Spread.of([])
