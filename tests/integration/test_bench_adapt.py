"""`shoal bench adapt` for real, on a small fleet: every floor and phase runs and nothing is lost.

No assertion on rates: timing is what the command reports (docs/benchmarks.md). What must
hold at any size: each plain subscriber drained what it was meant to, the adapters delivered
every measurement exactly once, and the CPU and memory figures were measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.processes import assert_ran, run_shoal

DEVICES = 20
STEPS = 10


@pytest.mark.slow  # 148 s at load 20 (measured): adapters, sink and publishers start per phase
def test_bench_adapt_json_runs_every_floor_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "adapt.json"
    result = run_shoal(
        *("bench", "adapt", "--devices", "json", "--count", str(DEVICES)),
        *("--steps", str(STEPS), "--publishers", "1", "--json", str(out)),
        timeout=240,
    )
    assert_ran(result)
    record = json.loads(out.read_text())
    messages = DEVICES * STEPS
    assert record["lost_measurements"] == 0
    assert [p["adapters"] for p in record["phases"]] == [1, 2]
    for phase in record["phases"]:
        assert phase["device_msgs"] == messages
        assert phase["extra_measurements"] == 0
        assert phase["adapter_cpu_s_per_1000_msgs"] > 0
        assert phase["adapter_rss_mb"] > 0
        assert phase["cores_busy"] > 0
        assert phase["machine_cores_busy"] > 0
        # every message acknowledged, in writes of at least one message each
        assert phase["device_msgs_per_ack_write"] >= 1
        assert phase["broker_wakeups_per_1000_msgs"] >= 0
    assert 1.0 <= record["two_adapters_ceiling"] <= 2.0
    floors = record["floors"]
    assert floors["batched"]["msgs"] == messages
    assert floors["aiomqtt"]["msgs"] == messages  # below PAHO_FLOOR_MESSAGES: all of them
    assert floors["c"]["msgs"] == messages  # mosquitto_sub -C exits once it counted them
    for name in ("c", "batched", "aiomqtt"):
        assert floors[name]["msgs_per_s"] > 0, name
    assert record["broker_plain_subscriber_msgs_per_s"] == floors["c"]["msgs_per_s"]
