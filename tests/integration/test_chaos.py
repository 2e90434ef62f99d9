"""``shoal bench chaos`` end to end: kill -9 of workers and combiners, a broker SIGKILL and
restart, worker pauses, a gateway restart and an overload at twice the measured capacity, all
in one run; the count oracle must show nothing lost and nothing duplicated.

The default variant is short; the ``slow`` one is the two-minute run of the README.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
import pytest

from shoal._processes import shoal_argv
from shoal.broker.embedded import default_broker
from shoal.loadtest.chaos import ChaosConfig, run_chaos

pytestmark = pytest.mark.broker


def _no_leftovers(before: set[int]) -> None:
    leftovers = [
        p.info
        for p in psutil.process_iter(["pid", "name", "cmdline"])
        if p.info["pid"] not in before
        and (p.info["name"] == "mosquitto" or "shoal.cli" in " ".join(p.info["cmdline"] or []))
        and p.info["pid"] in {c.pid for c in psutil.Process().children(recursive=True)}
    ]
    assert leftovers == []


def _check(record: dict, *, kills: int) -> None:
    m = record["measurements"]
    f = record["faults"]
    assert m["published"] > 0
    assert m["lost"] == 0, record
    assert m["duplicated"] == 0, record
    assert m["applied"] == m["published"]
    assert m["in_results"] + m["late"] == m["published"]
    assert record["results"]["conflicting_copies"] == 0
    if record["config"]["late_share"] > 0:  # the default: corrections through the kills
        assert record["results"]["corrections"] > 0
    assert record["batches"]["all_confirmed"]
    assert record["exact"]
    assert f["kills"] >= kills
    assert f["kills_by_kind"]["worker"] >= 1
    assert f["kills_by_kind"]["combiner"] >= 1
    assert f["broker_restarts"] == 1
    assert f["gateway_restarts"] == 1
    assert f["pauses"] >= 1
    assert f["overload_phases"] == 1
    overload = next(p for p in f["phases"] if p["kind"] == "overload")
    assert overload["details"]["offered_x_capacity"] >= 1.5
    assert record["memory"]["bounded"]
    peaks = record["memory"]["peak_rss_mb_by_kind"]
    assert {"broker", "combiner", "worker", "simulator"} <= set(peaks)


SLOWER: dict[str, float] = {"mosquitto": 1.0, "mochi": 2.0}
"""How much longer a run takes on each broker. Back to back on the shared 2-vCPU machine at
load average ~25 (2026-11-27), ``test_chaos_short``'s run took 96 s on Mosquitto and 192 s on
Mochi, both exact: Mochi spends several times Mosquitto's CPU per message (docs/brokers.md
difference 13) and re-sends a restored combiner's whole queue at once. In CI, on Mosquitto,
36-43 s. The timeout gives both brokers the same headroom."""


@pytest.mark.timeout(170 * SLOWER[default_broker()])
def test_chaos_short(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.process_iter()}
    record = run_chaos(
        ChaosConfig(
            duration_s=30.0,
            kill_interval_s=2.5,
            pause_s=2.0,
            probe_s=2.0,
            probe_rate=400_000.0,
            overload_s=4.0,
            run_dir=tmp_path / "run",
        )
    )
    _check(record, kills=4)
    _no_leftovers(before)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_two_minutes_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    result = subprocess.run(
        shoal_argv("bench", "chaos", "--duration", "120", "--json", str(out)),
        capture_output=True,
        text=True,
        check=False,
        timeout=880,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    record = json.loads(out.read_text())
    _check(record, kills=10)
    assert "peak RSS MB by kind" in result.stdout
