"""`shoal bench pool` for real, small: a pool worker (or, with --combiner, a pool combiner)
process serves (owns) every step's pipelines.

No assertion on the figures beyond their being measured: memory is what the command reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.loadtest.bench_pipelines import KEYS
from tests.support.processes import assert_ran, run_shoal

pytestmark = pytest.mark.broker


def test_pool_command_serves_every_step_and_reports_memory(tmp_path: Path) -> None:
    out = tmp_path / "pool.json"
    result = run_shoal("bench", "pool", "--counts", "1,6", "--json", str(out), timeout=120)
    assert_ran(result)
    assert "KB/pipeline" in result.stdout
    steps = json.loads(out.read_text())["steps"]
    assert [s["pipelines"] for s in steps] == [1, 6]
    assert all(s["rss_mb"] > 10 for s in steps)


def test_pool_command_refuses_bad_counts() -> None:
    result = run_shoal("bench", "pool", "--counts", "1,x", timeout=60)
    assert result.returncode != 0
    assert "--counts" in result.stderr


def test_pool_combiner_command_owns_every_step_and_reports_memory(tmp_path: Path) -> None:
    out = tmp_path / "hosts.json"
    argv = ("bench", "pool", "--combiner", "--counts", "1,5", "--json", str(out))
    result = run_shoal(*argv, timeout=120)
    assert_ran(result)
    assert "KB/partition" in result.stdout
    record = json.loads(out.read_text())
    assert record["bench"] == "pool-combiner"
    assert [s["pipelines"] for s in record["steps"]] == [1, 5]
    assert all(s["rss_mb"] > 10 for s in record["steps"])


def test_pipelines_command_deploys_feeds_and_counts_every_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "pipelines.json"
    argv = ("bench", "pipelines", "--count", "4", "--workers", "2", "--batches", "5")
    result = run_shoal(*argv, "--json", str(out), timeout=240)
    assert_ran(result)
    record = json.loads(out.read_text())
    assert set(KEYS) <= set(record)
    assert record["pipelines"] == 4
    assert (record["lost_measurements"], record["duplicated_measurements"]) == (0, 0)
    assert record["achieved_meas_per_s"] > 0
    assert record["worker_rss_mb"] > 10
    assert "load_average" in record["machine"]
