"""Bounded hold with bad gateway clocks, through a real broker (issue 14, item 1).

Three gateways publish at once: one on time, one whose clock runs an hour ahead (every batch
refused by the workers: timestamps too far in the future), one whose clock runs an hour
behind (accepted, but an hour behind everyone). Before the bounded hold, the refused batches
of the gateway ahead counted as progress without event time and the gateway behind held the
pipeline watermark an hour back: no window of the on-time gateway closed until a flush.
Now neither may hold the others' windows for longer than ``max_hold_ms``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from shoal._cli.common import load_spec
from shoal.broker import AsyncSession
from shoal.broker.session import unique_client_id
from shoal.runtime.local import Accounting, LocalPipeline, LocalPipelineConfig

pytestmark = pytest.mark.broker

LATENESS_MS = 500
MAX_HOLD_MS = 3_000
MAX_DELAY_MS = 500  # gateways seal a batch at least this often
HOUR_MS = 3_600_000
SPEC = f"""
name = "skew"
inputs = ["ingest/+/+"]
key = "sensor_id"
lateness_ms = {LATENESS_MS}
idle_timeout_ms = 2000
max_hold_ms = {MAX_HOLD_MS}
checkpoint_interval_ms = 500
aggregates = ["count", "mean"]

[[windows]]
kind = "tumbling"
size_ms = 1000

[limits]
max_future_ms = 300000
"""
GATEWAYS = {"ok-gw": 0, "ahead-gw": HOUR_MS, "behind-gw": -HOUR_MS}
LOAD_S = 12.0


def _simulate(local: LocalPipeline, tmp_path: Path, prefix: str, offset_ms: int) -> None:
    local.start_simulator(
        [
            *("--gateways", "1", "--sensors", "50", "--rate", "20", "--batch", "500"),
            *("--max-delay-ms", str(MAX_DELAY_MS), "--gateway-prefix", prefix),
            *("--clock-offset-ms", str(offset_ms), "--duration", str(LOAD_S)),
            *("--spool", "memory", "--wait-confirmed", "120", "-q"),
            *("--json", str(tmp_path / f"{prefix}.json")),
        ],
        name=f"simulator-{prefix}",
    )


def _status(local: LocalPipeline, spec_path: Path) -> dict[str, Any]:
    """``shoal status --json`` of the running pipeline, as a user would run it."""
    argv = [sys.executable, "-m", "shoal.cli", "status", "--pipeline", str(spec_path)]
    argv += ["--broker", local.broker.settings.url, "--wait", "2", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    text = subprocess.run(
        [a for a in argv if a != "--json"], capture_output=True, text=True, timeout=60, check=True
    )
    print(text.stdout)
    status = json.loads(done.stdout)
    assert isinstance(status, dict)
    return status


def _run(tmp_path: Path) -> tuple[Accounting, list[dict[str, Any]], dict[str, Any]]:
    spec_path = tmp_path / "skew.toml"
    spec_path.write_text(SPEC)
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=load_spec(str(spec_path)),
            spec_source=str(spec_path),
            workers=2,
            run_dir=tmp_path / "run",
            per_key_results=False,
        )
    )
    results: list[dict[str, Any]] = []

    async def collect(session: AsyncSession) -> None:
        async for message in session.messages():
            body = orjson.loads(message.payload)
            results.append({k: body[k] for k in ("start", "end", "emitted_at", "rows")})

    async def main() -> tuple[Accounting, dict[str, Any]]:
        async with (
            local.watching() as session,
            AsyncSession(local.broker.settings, unique_client_id("skew-test")) as reader,
        ):
            await reader.subscribe([local.topics.results("skew")], qos=1)
            collector = asyncio.create_task(collect(reader))
            assert await local.until(lambda s: len(s.workers) == 2, 60), "no workers"
            for prefix, offset in GATEWAYS.items():
                _simulate(local, tmp_path, prefix, offset)
            await asyncio.sleep(LOAD_S - 3.5)
            status = await asyncio.to_thread(_status, local, spec_path)
            accounting = await local.settle(session, timeout_s=60.0)
            collector.cancel()
            return accounting, status

    try:
        local.start()
        accounting, progress = asyncio.run(main())
    finally:
        local.stop()
    return accounting, results, progress


def test_gateways_with_clocks_an_hour_off_hold_the_on_time_windows_for_max_hold_at_most(
    tmp_path: Path,
) -> None:
    started_ms = time.time_ns() // 1_000_000
    accounting, results, status = _run(tmp_path)
    reports = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in GATEWAYS}

    # The on-time gateway's windows (the only ones ending near now) closed within the bound,
    # while the run went on (not at the final flush).
    on_time = [r for r in results if started_ms - 60_000 < r["end"] < started_ms + HOUR_MS]
    assert len(on_time) >= 5, results
    delays = sorted(r["emitted_at"] - r["end"] for r in on_time)
    slack = MAX_DELAY_MS + 1_500  # batching, a combiner tick, two checkpoints
    assert delays[-1] <= LATENESS_MS + MAX_HOLD_MS + slack, delays
    print(f"on-time windows: close delay max {delays[-1]} ms, median {delays[len(delays) // 2]}")

    # What `shoal status` said near the end: the gateway behind was released (its clock an
    # hour behind); the gateway ahead, all of whose input was refused, holds nothing; the
    # on-time gateway is what the windows wait for.
    gateways = {g["id"]: g for g in status["gateways"]}
    behind, ahead, on_time = gateways["behind-gw000"], gateways["ahead-gw000"], gateways["ok-gw000"]
    assert behind["released"], behind
    assert not behind["holding"], behind
    assert behind["clock_offset_ms"] > HOUR_MS - 60_000, behind
    assert behind["event_time_behind_ms"] > HOUR_MS - 60_000, behind
    assert ahead["refused_batches"] > 0, ahead
    assert not ahead["holding"], ahead
    assert ahead["watermark"] is None, ahead
    assert on_time["holding"], on_time
    assert not on_time["released"], on_time
    assert all(p["waiting_for"] == ["ok-gw000"] for p in status["partitions"]), status
    assert len(status["workers"]) == 2, status

    # Every measurement is accounted for: applied (in results or late) or dead-lettered.
    refused_rows = reports["ahead-gw"]["rows_sealed"]
    assert refused_rows > 0
    assert accounting.unconfirmed_batches == 0, accounting
    assert accounting.generated == accounting.applied + refused_rows, accounting
    assert accounting.in_results + accounting.late == accounting.applied, accounting
    assert accounting.late > 0, accounting  # the gateway behind, after its release
    assert accounting.deadletters >= reports["ahead-gw"]["batches_sealed"], accounting
