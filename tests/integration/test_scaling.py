"""Scaling with real processes and a real broker: drained scale-down, crash replacement, the
scaler's HTTP endpoint, and the scaling benchmark's code path."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from shoal._cli.common import load_spec
from shoal.runtime.local import Accounting, LocalPipeline, LocalPipelineConfig
from shoal.runtime.scaler import Scaler, ScalerConfig
from shoal.scaler.backends import LocalBackend
from shoal.scaler.policy import Bounds

pytestmark = pytest.mark.broker

SHOAL = [sys.executable, "-m", "shoal.cli"]
# 2 gateways x 200 sensors x 50/s = 20,000 measurements/s in batches of 1,000.
LOAD = ["--gateways", "2", "--sensors", "200", "--rate", "50", "--batch", "1000"]


def simulate(local: LocalPipeline, seconds: float) -> None:
    local.start_simulator(
        [*LOAD, "--duration", str(seconds), "--spool", "memory", "--wait-confirmed", "60", "-q"]
    )


def pipeline(tmp_path: Path, workers: int) -> LocalPipeline:
    return LocalPipeline(
        LocalPipelineConfig(
            spec=load_spec("default"), spec_source="default", workers=workers, run_dir=tmp_path
        )
    )


def test_scale_down_under_load_drains_without_loss(tmp_path: Path) -> None:
    local = pipeline(tmp_path, workers=3)

    async def main() -> tuple[Accounting, int, int, int]:
        async with local.watching() as session:
            assert await local.until(lambda s: len(s.workers) == 3, 60), "workers did not start"
            simulate(local, 12)
            assert await local.until(lambda s: s.batch_rows_applied >= 40_000, 60)
            leaving = local.backend.live[1:]
            local.backend.scale_to(1)  # SIGTERM to the two newest: they drain
            before = local.monitor.snapshot().batch_rows_applied
            for child in leaving:
                assert await asyncio.to_thread(child.wait, 60) == 0, child.log_tail()
            # Under load: the gateways were still publishing when both had left.
            assert local.simulator is not None
            assert local.simulator.alive()
            after = local.monitor.snapshot().batch_rows_applied
            local.backend.observe()
            drained = local.backend.stats.drained
            # Let the load run its course with the one worker left, then account.
            await asyncio.to_thread(local.simulator.wait, 90)
            accounting = await local.settle(session)
            return accounting, before, after, drained

    local.start()
    try:
        accounting, applied_before, applied_after, drained = asyncio.run(main())
    finally:
        local.stop()
    assert accounting.exact, accounting
    assert accounting.generated >= 200_000
    assert drained == 2
    assert local.backend.stats.crashed == 0
    # Most of the load came after the scale-down, through the one worker left.
    assert accounting.applied > 2 * applied_after >= 2 * applied_before
    for name in ("worker-1", "worker-2"):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "draining" in log
        assert "drained" in log


def test_a_crashed_worker_is_replaced_and_nothing_is_lost(tmp_path: Path) -> None:
    local = pipeline(tmp_path, workers=2)

    async def main() -> Accounting:
        async with local.watching() as session:
            assert await local.until(lambda s: len(s.workers) == 2, 60), "workers did not start"
            simulate(local, 10)
            assert await local.until(lambda s: s.batch_rows_applied >= 40_000, 60)
            victim = local.backend.live[0]
            victim.kill()  # SIGKILL: no drain, un-acked batches are re-sent by the gateways
            # The backend notices (local.watching() observes it twice a second) and replaces it.
            for _ in range(100):
                if local.backend.stats.replaced:
                    break
                await asyncio.sleep(0.1)
            assert local.backend.stats.replaced == 1
            assert len(local.backend.live) == 2
            assert victim not in local.backend.live
            assert await local.until(lambda s: len(s.workers) == 2, 60)
            assert local.simulator is not None
            await asyncio.to_thread(local.simulator.wait, 90)
            return await local.settle(session)

    local.start()
    try:
        accounting = asyncio.run(main())
    finally:
        local.stop()
    assert accounting.exact, accounting
    assert local.backend.stats.crashed == 1
    assert local.backend.stats.started == 3


def test_scaler_serves_lag_for_prometheus_and_keda(tmp_path: Path) -> None:
    """The scaler with its own broker session: lag figures on /metrics and /api/v1/scaling."""
    local = pipeline(tmp_path, workers=1)
    spec = load_spec("default")

    async def main() -> tuple[str, dict[str, object]]:
        backend = LocalBackend(local._spawn_worker)  # the scaler's own workers
        scaler = Scaler(
            ScalerConfig(
                spec=spec,
                broker=local.broker.settings,
                topics=local.topics,
                bounds=Bounds(1, 2),
                http_port=0,
                interval_s=0.5,
            ),
            backend,
        )
        task = asyncio.create_task(scaler.run())
        try:
            simulate(local, 6)
            for _ in range(200):
                if scaler.bound_port and scaler.monitor.snapshot().rows_generated > 20_000:
                    break
                await asyncio.sleep(0.1)
            base = f"http://127.0.0.1:{scaler.bound_port}"
            text = await asyncio.to_thread(_get, f"{base}/metrics")
            body = json.loads(await asyncio.to_thread(_get, f"{base}/api/v1/scaling"))
            missing = await asyncio.to_thread(_status, f"{base}/nope")
            assert missing == 404
            return text, body
        finally:
            scaler.stop()
            await asyncio.wait_for(task, 30)

    local.start()
    try:
        text, body = asyncio.run(main())
    finally:
        local.stop()
    assert body["pipeline"] == "default"
    assert body["policy"] == "lag"
    assert body["desired_workers"] in (1, 2)
    assert isinstance(body["lag_measurements"], int)
    assert body["arrival_measurements_per_s"] > 0
    for name in (
        "shoal_lag_batches",
        "shoal_lag_measurements",
        "shoal_arrival_measurements_per_second",
        "shoal_workers_desired",
        "shoal_measurements_generated_total",
    ):
        assert f"# TYPE {name} " in text, name
        assert f'{name}{{pipeline="default"}}' in text, name


def test_bench_scaling_runs_a_trace_and_accounts_for_it(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    result = subprocess.run(
        [
            *SHOAL,
            "bench",
            "scaling",
            "--policy",
            "lag",
            "--trace",
            "spike",
            "--pipeline",
            "default",
            "--sensors",
            "100",
            "--rate",
            "20",
            "--batch",
            "1000",
            "--time-scale",
            "0.2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["trace"]["name"] == "spike"
    [run] = record["policies"]
    assert run["policy"] == "lag"
    assert run["lost"] == 0
    assert run["duplicated"] == 0
    assert run["generated"] > 0
    assert run["applied"] == run["generated"]
    assert len(run["samples"]) >= record["trace"]["duration_s"] - 2
    assert {s["gateways"] for s in run["samples"]} >= {1, 10}
    assert "max lag meas" in result.stdout


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
