"""`shoal bench pipeline` at a low rate over many keys: batches sealed by age, out of step.

At 500 measurements/s per gateway a 16,000-row batch takes 32 s to fill, longer than the run;
the gateways seal by age instead, out of step, and the achieved rate reads to the resolution
the record states (`sealing`), where gateways sealing in lock-step read to +-10 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.broker  # it starts its own embedded broker

SHOAL = [sys.executable, "-m", "shoal.cli"]


def test_a_low_rate_over_20000_keys_is_measured_to_the_stated_resolution(tmp_path: Path) -> None:
    out = tmp_path / "low.json"
    argv = [*SHOAL, "bench", "pipeline", "--scenario", "B", "--sensors", "2000", "--rate", "0.25"]
    argv += ["--window", "tumbling", "--duration", "5", "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["sensors"] == 20_000
    assert record["offered_meas_per_s"] == 5_000
    seal = record["sealing"]
    assert seal["sealed_by"] == "age"
    assert seal["fill_ms"] == pytest.approx(32_000.0)
    assert seal["max_delay_ms"] == 250  # 0.5 % of 10 gateways x 5 s
    assert seal["staggered"] is True
    assert seal["resolution"] == pytest.approx(0.005)
    # Every gateway sealed every 250-350 ms (the age, then the next 50-ms tick's rows) over
    # the 3 s of warm-up and 5 s measured: not once a second.
    assert record["batches_published"] >= 10 * (5 + 3) / 0.4
    assert record["lost_measurements"] == 0
    assert record["duplicated_measurements"] == 0
    # +-0.5 % at either end, and a pipeline idling at 5,000/s: not the +-10 % of lock-step.
    assert record["achieved_meas_per_s"] == pytest.approx(5_000, rel=0.03)
    assert "gateways out of step" in result.stdout
