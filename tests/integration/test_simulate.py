"""The simulator against a real broker: open loop, achieved ≈ offered, numbers that add up."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.cli import main
from shoal.loadtest.simulate import SimulationConfig, Simulator
from shoal.schemas import Encoding


@pytest.mark.parametrize(
    ("spool", "sink"), [("disk", "confirm"), ("memory", "count"), ("off", "count")]
)
def test_a_short_run_achieves_the_offered_rate(broker, topics, tmp_path, spool, sink) -> None:
    config = SimulationConfig(
        gateways=2,
        sensors=200,
        rate_hz=25,  # 10,000 measurements/s
        batch_size=2000,
        encoding=Encoding.BINARY_COLUMNAR,
        duration_s=3,
        spool=spool,
        spool_dir=tmp_path / "spool" if spool == "disk" else None,
        sink=sink,
        topics=topics,
        broker=broker.settings,
    )
    progress = []
    report = Simulator(config, observe={"broker": broker.pid}).run(progress=progress.append)

    assert not report.stopped_early
    assert report.offered_rows == pytest.approx(30_000, rel=0.01)
    assert report.offered_rate == pytest.approx(config.offered_rate, rel=0.01)
    # Short runs pay the final flush and PUBACK within few seconds: 5% rather than 2%.
    assert report.achieved_ratio == pytest.approx(1.0, abs=0.05)
    assert report.all_published
    # Everything generated was sealed, published, and counted by the subscriber once.
    assert report.rows_sealed == report.offered_rows
    assert report.rows_published == report.rows_sealed
    assert report.sink is not None
    assert report.sink["rows"] == report.rows_published
    assert report.sink["batches"] == report.batches_published == report.batches_sealed
    assert report.sink["errors"] == 0
    assert report.bytes_published > 0
    assert report.cpu_s > 0
    assert 0 < report.cpu_percent < 100
    assert "broker" in report.observed_cpu
    assert "sink" in report.observed_cpu
    if sink == "confirm" or spool == "off":
        assert report.confirmed is True
        assert report.spool_batches_end == 0
    else:
        assert report.spool_batches_end == report.batches_sealed  # nobody confirmed
    assert len(progress) >= 2
    assert progress[-1].offered_rows <= report.offered_rows


def test_cli_runs_a_scenario_with_an_embedded_broker(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    code = main(
        [
            "simulate",
            "--scenario",
            "A",
            "--sensors",
            "100",
            "--batch",
            "1000",
            "--duration",
            "2",
            "--embedded",
            "--spool",
            "memory",
            "--sink",
            "confirm",
            "--json",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    report = json.loads(out.read_text())
    assert report["config"]["gateways"] == 1
    assert report["config"]["sensors"] == 100
    assert report["config"]["encoding"] == "binary-columnar"
    assert report["sink"]["rows"] == report["rows_published"] == report["offered_rows"]
    assert "of offered [OK" in captured.out
    assert "% of one core" in captured.out
    assert "offered" in captured.err  # progress lines


def test_cli_refuses_embedded_with_a_broker_url(capsys) -> None:
    assert main(["simulate", "--embedded", "--broker", "mqtt://localhost:1"]) == 2
    assert "--embedded" in capsys.readouterr().err


def test_cli_runs_gateways_whose_clocks_jump_and_that_send_late_rows(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    argv = ["simulate", "--sensors", "100", "--rate", "20", "--batch", "500", "--duration", "2"]
    argv += ["--clock-jump-ms", "-30000", "--clock-jump-at-s", "1", "--late-share", "0.1"]
    argv += ["--late-by-ms", "5000", "--seed", "4", "--embedded", "--spool", "memory"]
    code = main([*argv, "--sink", "confirm", "--json", str(out), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    report = json.loads(out.read_text())
    assert report["config"]["late_share"] == 0.1
    # A jump back does not silence the sensors: the whole rate is offered and delivered.
    assert report["sink"]["rows"] == report["rows_published"] == report["offered_rows"]
    assert report["offered_rows"] == pytest.approx(4_000, rel=0.05)
    assert report["rows_made_late"] == pytest.approx(400, rel=0.3)
    assert "rows stamped back (--late-share)" in captured.out


def test_cli_exits_0_when_a_broker_restart_makes_it_resend(tmp_path, capsys) -> None:
    # A broker that goes away for a while mid-run: the gateway spools, reconnects, publishes
    # the backlog and re-sends what was unconfirmed (for a while faster than the offered
    # rate); the sink reconnects and confirms (again, for re-sends).
    # Everything was confirmed, so the run passes, whatever the momentary rate was.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    broker = EmbeddedBroker("dev", port=port, data_dir=tmp_path / "broker")
    broker.start()
    out = tmp_path / "report.json"
    argv = ["simulate", "--broker", f"mqtt://127.0.0.1:{port}", "--sensors", "100"]
    argv += ["--rate", "20", "--batch", "500", "--duration", "8", "--spool", "disk"]
    argv += ["--spool-dir", str(tmp_path / "spool"), "--sink", "confirm", "--json", str(out)]
    argv += ["--topic-root", f"restart{port}", "-q"]

    def restart_with_a_gap() -> None:
        time.sleep(3.0)  # the CLI starts (imports, sink, connect) and publishes a while
        broker.stop()
        time.sleep(2.0)  # batches sealed meanwhile wait in the spool
        broker.start()

    # The CLI installs signal handlers, so it runs in the main thread and the broker's
    # outage in another.
    outage = threading.Thread(target=restart_with_a_gap)
    try:
        outage.start()
        code = main(argv)
        outage.join(30)
    finally:
        broker.close()
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    report = json.loads(out.read_text())
    assert report["spool_batches_max"] >= 4  # the outage held batches back
    assert report["all_published"] is True
    assert report["confirmed"] is True
    assert report["delivered"] is True
    assert report["rows_published"] == report["offered_rows"] == report["sink"]["rows"]
    assert "every batch accepted by the broker and confirmed (exit 0)" in captured.out
