"""The commands a user runs first: `shoal up` (make demo) and `shoal bench pipeline`."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shoal._spawn import DIES_WITH_PARENT, spawn_tied
from shoal.processors.spec import default_state_cells
from shoal.runtime._memory import usable_memory_bytes

pytestmark = pytest.mark.broker  # they start their own embedded broker

SHOAL = [sys.executable, "-m", "shoal.cli"]


def test_up_runs_a_demo_and_accounts_for_every_measurement(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *SHOAL,
            "up",
            "--duration",
            "8",
            "--scenario",
            "A",
            "--rate",
            "5",
            "--batch",
            "1000",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "verdict: zero loss" in out
    generated = int(out.split("measurements generated")[1].split()[0].replace(",", ""))
    applied = int(out.split("applied")[-1].split()[0].replace(",", ""))
    # Accounting, not throughput: a loaded machine generates fewer batches (10-18k seen at
    # load 9); what matters is that every one generated was applied.
    assert generated >= 1_000, "the demo generated less than one batch"
    assert applied == generated
    assert "window results" in out
    assert "dashboard: http://127.0.0.1:" in out  # the page of `shoal view` (test_view_*.py)
    assert (tmp_path / "logs" / "worker-0.log").exists()


def test_up_runs_a_control_plane_that_shoal_pipeline_talks_to(tmp_path: Path) -> None:
    argv = [*SHOAL, "up", "--duration", "60", "--scenario", "none", "--scale", "off"]
    argv += ["--workers", "1", "--run-dir", str(tmp_path), "--pinned"]
    up = spawn_tied(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        while line and "control plane running" not in line:
            line = up.stdout.readline()
        url = line.rsplit("--broker ", 1)[1].strip()
        log = tmp_path / "logs" / "control.log"
        deadline = time.monotonic() + 30
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the control plane never became ready"
            time.sleep(0.2)

        def pipeline(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
            command = [*SHOAL, "pipeline", *args, "--json", "--broker", url, "--timeout", "20"]
            return subprocess.run(
                command, input=stdin, capture_output=True, text=True, timeout=60, check=False
            )

        spec = 'name = "extra"\n[[windows]]\nsize_ms = 5000\n'
        # `shoal up --pinned` runs no pool worker: stored is what can be confirmed here.
        deployed = pipeline("deploy", "-", "--no-wait", stdin=spec)
        assert deployed.returncode == 0, deployed.stderr
        listed = pipeline("list")
        assert listed.returncode == 0, listed.stderr
        assert [p["name"] for p in json.loads(listed.stdout)["pipelines"]] == ["extra"]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.communicate(timeout=120)
        finally:
            up.kill()  # a hung run must not outlive the test (its children die with it)
            up.wait(10)
    assert up.returncode == 0


def test_up_serves_a_pipeline_deployed_while_it_runs(tmp_path: Path) -> None:
    """`shoal up` as a user starts it; a second pipeline deployed, served and deleted."""
    argv = [*SHOAL, "up", "--duration", "120", "--scenario", "A", "--rate", "5", "--batch"]
    argv += ["1000", "--scale", "off", "--workers", "2", "--run-dir", str(tmp_path)]
    argv += ["--view-port", "-1"]
    up = spawn_tied(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline()]
        while lines[-1] and "deployed through the control plane" not in lines[-1]:
            lines.append(up.stdout.readline())
        assert "pipeline 'default' deployed v1" in lines[-1], "".join(lines)
        url = next(x for x in lines if "control plane running" in x).rsplit("--broker ", 1)[1]
        broker = ["--broker", url.strip()]

        def shoal(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*SHOAL, *args, *broker],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
            )

        # A different computation (not an alias of default): its own results.
        spec = 'name = "extra"\n[[windows]]\nsize_ms = 2000\n'
        deployed = shoal("pipeline", "deploy", "-", "--json", "--timeout", "30", stdin=spec)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert json.loads(deployed.stdout)["confirmed"]["workers"], deployed.stdout
        for name in ("extra", "default"):
            tail = shoal("tail", name, "--json", "--count", "1", "--timeout", "40")
            windows = [json.loads(x) for x in tail.stdout.splitlines()]
            assert windows, f"no result for {name}: {tail.stderr}"
            assert all(w["pipeline"] == name for w in windows), windows[0]
        status = shoal("status", "--pipeline", "extra")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "pipeline extra" in status.stdout, status.stdout
        deleted = shoal("pipeline", "delete", "extra", "--json")
        assert deleted.returncode == 0, deleted.stderr
        listed = shoal("pipeline", "list", "--json")
        names = [p["name"] for p in json.loads(listed.stdout)["pipelines"] if not p.get("deleted")]
        assert names == ["default"], listed.stdout
        up.send_signal(signal.SIGINT)  # Ctrl-C: settle and account, as a user stops it
        out, _ = up.communicate(timeout=120)
    finally:
        up.kill()  # a hung run must not outlive the test (its children die with it)
        up.wait(10)
    assert up.returncode == 0, out[-3000:]
    assert "verdict: zero loss" in out
    generated = int(out.split("measurements generated")[1].split()[0].replace(",", ""))
    assert int(out.split("counted in results")[1].split()[0].replace(",", "")) == generated
    assert generated >= 1_000


@pytest.mark.skipif(not DIES_WITH_PARENT, reason="PR_SET_PDEATHSIG is Linux-only")
def test_up_killed_with_sigkill_takes_its_broker_and_components_along(tmp_path: Path) -> None:
    # What a test's subprocess timeout does: SIGKILL, no cleanup in `shoal up` itself.
    argv = [*SHOAL, "up", "--duration", "300", "--scenario", "A", "--rate", "2"]
    argv += ["--batch", "500", "--scale", "off", "--workers", "2", "--run-dir", str(tmp_path)]
    up = spawn_tied(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[psutil.Process] = []
    try:
        parent = psutil.Process(up.pid)
        # Broker, combiner(s), control plane, two workers and the simulator, all running.
        deadline = time.monotonic() + 60
        while not (tmp_path / "logs" / "simulator.log").exists() or len(children) < 6:
            assert up.poll() is None, "shoal up exited by itself"
            assert time.monotonic() < deadline, f"shoal up started only {children}"
            time.sleep(0.2)
            children = parent.children(recursive=True)
        names = sorted(" ".join(c.cmdline()[2:5]) for c in children)
        brokers = ("mosquitto", "shoal-mochi")  # SHOAL_TEST_BROKER picks one
        assert any(b in " ".join(c.cmdline()) for c in children for b in brokers), names
        time.sleep(2.0)  # data flowing: batches in flight, checkpoints, confirmations
        up.kill()
        up.wait(10)
        killed_at = time.monotonic()
        alive = children
        while alive and time.monotonic() - killed_at < 10:
            time.sleep(0.1)
            alive = [c for c in alive if _running(c)]
        assert alive == [], f"still running 10 s after shoal up was killed: {alive}"
    finally:
        up.kill()
        up.wait(10)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent in a container)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_bench_pipeline_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = subprocess.run(
        [
            *SHOAL,
            "bench",
            "pipeline",
            "--scenario",
            "A",
            "--rate",
            "4",
            "--batch",
            "1000",
            "--duration",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    for key in (
        "offered_meas_per_s",
        "achieved_meas_per_s",
        "lost_measurements",
        "duplicated_measurements",
        "apply_latency_ms",
        "result_latency_ms",
        "components",
    ):
        assert key in record, key
    assert record["offered_meas_per_s"] == 4_000
    assert record["lost_measurements"] == 0
    assert record["duplicated_measurements"] == 0
    assert set(record["apply_latency_ms"]) >= {"p50", "p95", "p99"}
    # the combiner held state during the run, below the default cap (sized from this
    # machine's memory: the combiner runs here)
    cap = default_state_cells(usable_memory_bytes())
    assert 0 < record["peak_state_cells"] <= record["max_state_cells"] == cap
    names = {c["name"] for c in record["components"]}
    assert {"broker", "combiner-0", "worker-0", "worker-1", "simulator"} <= names
    for component in record["components"]:
        assert component["cpu_percent"] >= 0
        assert component["rss_mb"] > 0
