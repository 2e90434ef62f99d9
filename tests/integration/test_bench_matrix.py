"""`shoal bench matrix` for real: a smoke run in every test run, the quick one in `make bench`.

The smoke run has tiny rates and no assertion on timing: it keeps the code path (baseline
server and driver, shoal pipeline, encoding study, tables, plots) from rotting, and checks
the document's structure and that shoal lost nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SHOAL = [sys.executable, "-m", "shoal.cli", "bench", "matrix"]


def _run(tmp_path: Path, *flags: str, timeout: float) -> tuple[dict[str, Any], str]:
    out = tmp_path / "m.json"
    result = subprocess.run(
        [*SHOAL, *flags, "--json", str(out), "--markdown", str(tmp_path / "m.md")],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def _assert_no_loss(document: dict[str, Any]) -> None:
    for cell in document["cells"]:
        for run in cell["shoal"]:
            assert run["loss_measurements"] == 0, run["variant"]
            assert run["run"]["unconfirmed_batches"] == 0


@pytest.mark.broker
def test_smoke_run_writes_every_part(tmp_path: Path) -> None:
    document, stdout = _run(tmp_path, "--smoke", "--no-max", "--plots", str(tmp_path), timeout=240)
    assert document["kind"] == "shoal-bench-matrix"
    (cell,) = document["cells"]
    assert cell["baseline"]["system"] == "baseline"
    assert cell["baseline"]["t_rr_ms"]["n"] > 0
    assert cell["baseline"]["bytes_per_meas"] > 50
    (ours,) = cell["shoal"]
    assert ours["variant"] == "binary-columnar"
    assert ours["t_rr_ms"]["n"] > 0
    assert ours["t_ex_ms"]["n"] > 0
    assert ours["sut_cpu_percent"] > 0
    assert set(ours["vs_baseline"]) >= {"t_rr_p99", "per_core_meas_per_s", "bytes_per_meas"}
    _assert_no_loss(document)
    assert {r["attributes"] for r in document["encodings"]} == {1, 10}
    assert "### The grid" in stdout
    assert (tmp_path / "m.md").read_text().startswith("Run `smoke`")
    assert (tmp_path / "trr-cdf.png").exists()


@pytest.mark.benchmark
def test_quick_matrix_within_ten_minutes(tmp_path: Path) -> None:
    document, _ = _run(tmp_path, "--quick", timeout=900)
    print(json.dumps(document["targets"], indent=2))
    assert document["wall_s"] < 600
    _assert_no_loss(document)
    assert set(document["targets"]) == {
        "throughput_per_core",
        "p99_publish_to_partial_at_A_4000",
        "p99_t_rr_at_A_4000",
    }
