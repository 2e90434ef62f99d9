"""Lag arithmetic and tallies of the pipeline monitor, fed hand-made messages (no broker)."""

from __future__ import annotations

import orjson
import pytest

from shoal.broker.session import Message
from shoal.clock import FakeClock
from shoal.processors.spec import parse_pipeline
from shoal.scaler.monitor import HEARTBEAT_TIMEOUT_MS, PipelineMonitor
from shoal.scaler.signals import signals_from
from shoal.schemas.control import Confirm, GatewayStatus
from shoal.schemas.topics import Topics

T = Topics()


def spec(partitions: int = 1, windows=None):
    return parse_pipeline(
        {
            "name": "p",
            "partitions": partitions,
            "aggregates": ["count", "mean"],
            "windows": windows or [{"kind": "tumbling", "size_ms": 10_000}],
        }
    )


def status(gateway: str, *, next_seq: int, first_unconfirmed: int, rows: int, **kw) -> Message:
    body = GatewayStatus(
        gateway_id=gateway,
        stream="s",
        next_seq=next_seq,
        first_unconfirmed_seq=first_unconfirmed,
        unconfirmed_batches=next_seq - first_unconfirmed,
        unconfirmed_rows=rows,
        oldest_unconfirmed_ms=kw.get("oldest"),
        spool_bytes=0,
        rows_total=kw.get("total", 0),
        at_ms=kw.get("at", 0),
    )
    return Message(T.gateway_status(gateway), body.to_json())


def confirm(gateway: str, seq: int, partition: int = 0, partitions: int = 1, pipeline="p"):
    body = Confirm(gateway, pipeline, partition, partitions, seq, 0)
    return Message(T.confirm(gateway, pipeline, partition), body.to_json())


def metrics(body: dict) -> Message:
    return Message(T.metrics(body["component"], str(body.get("id", "x"))), orjson.dumps(body))


def test_lag_is_last_published_minus_confirmed_per_gateway() -> None:
    monitor = PipelineMonitor(spec(), T, FakeClock())
    monitor.on_message(status("g1", next_seq=11, first_unconfirmed=0, rows=11_000))
    monitor.on_message(status("g2", next_seq=5, first_unconfirmed=3, rows=2_000))
    monitor.on_message(confirm("g1", 7))
    lag = {g.gateway_id: g for g in monitor.gateway_lag()}
    assert (lag["g1"].last_seq, lag["g1"].confirmed_seq, lag["g1"].batches) == (10, 7, 3)
    # No confirmation seen for g2 yet: the gateway's own first unconfirmed seq counts.
    assert (lag["g2"].confirmed_seq, lag["g2"].batches) == (2, 2)
    snap = monitor.snapshot()
    assert snap.lag_batches == 5
    assert snap.lag_rows == 13_000


def test_every_partition_must_confirm() -> None:
    monitor = PipelineMonitor(spec(partitions=3), T, FakeClock())
    monitor.on_message(status("g", next_seq=20, first_unconfirmed=0, rows=0))
    monitor.on_message(confirm("g", 19, partition=0, partitions=3))
    monitor.on_message(confirm("g", 12, partition=2, partitions=3))
    # Partition 1 has confirmed nothing: the slowest partition defines the lag.
    assert monitor.gateway_lag()[0].batches == 20
    monitor.on_message(confirm("g", 15, partition=1, partitions=3))
    assert monitor.gateway_lag()[0].confirmed_seq == 12
    assert monitor.gateway_lag()[0].batches == 7


def test_confirmations_of_other_pipelines_do_not_count() -> None:
    monitor = PipelineMonitor(spec(), T, FakeClock())
    monitor.on_message(status("g", next_seq=10, first_unconfirmed=0, rows=0))
    monitor.on_message(confirm("g", 9, pipeline="other"))
    assert monitor.snapshot().lag_batches == 10


def test_a_gateway_that_dropped_confirmed_batches_is_not_lagging_on_them() -> None:
    """After a restart the monitor may have missed confirms; the gateway's spool is the truth."""
    monitor = PipelineMonitor(spec(), T, FakeClock())
    monitor.on_message(confirm("g", 3))
    monitor.on_message(status("g", next_seq=50, first_unconfirmed=48, rows=100))
    assert monitor.gateway_lag()[0].batches == 2


def test_oldest_unconfirmed_age_is_measured_on_the_gateways_clock() -> None:
    clock = FakeClock()
    monitor = PipelineMonitor(spec(), T, clock)
    # The gateway's clock is an hour ahead; its oldest batch was sealed 800 ms before it spoke.
    ahead = clock.now_ms() + 3_600_000
    monitor.on_message(
        status("g", next_seq=3, first_unconfirmed=1, rows=10, oldest=ahead - 800, at=ahead)
    )
    clock.advance(200)
    assert monitor.snapshot().oldest_unconfirmed_age_ms == 1_000


def test_nothing_unconfirmed_has_no_age() -> None:
    monitor = PipelineMonitor(spec(), T, FakeClock())
    monitor.on_message(status("g", next_seq=3, first_unconfirmed=3, rows=0))
    snap = monitor.snapshot()
    assert snap.lag_batches == 0
    assert snap.oldest_unconfirmed_age_ms is None


def test_arrival_rate_from_the_gateways_running_totals() -> None:
    clock = FakeClock()
    monitor = PipelineMonitor(spec(), T, clock)
    for second in range(5):
        for g in ("a", "b"):
            monitor.on_message(
                status(g, next_seq=1, first_unconfirmed=1, rows=0, total=second * 50_000)
            )
        clock.advance(1_000)
    assert monitor.snapshot().rows_in_per_s == pytest.approx(100_000, rel=1e-6)


def test_results_and_late_rows_count_measurements_once_even_for_hopping_windows() -> None:
    hopping = [{"kind": "hopping", "size_ms": 60_000, "slide_ms": 20_000, "name": "h"}]
    monitor = PipelineMonitor(spec(windows=hopping), T, FakeClock())
    # 10 measurements, each in 3 windows: 24 memberships counted in results, 6 reported late.
    for rows in (10, 9, 5):
        result = {"window": "h", "start": 0, "rows": rows, "results": []}
        monitor.on_message(Message(T.results("p"), orjson.dumps(result)))
    late = {"rows": 6, "late": [{"window": "h", "rows": 6}]}
    monitor.on_message(Message(T.late("p"), orjson.dumps(late)))
    snap = monitor.snapshot()
    assert snap.windows_per_row == 3
    assert snap.window_memberships == 30  # = 10 measurements x 3 windows: exact
    assert snap.rows_in_results == 8
    assert snap.late_rows == 2


def test_workers_are_live_until_their_heartbeat_times_out_or_they_say_goodbye() -> None:
    clock = FakeClock()
    monitor = PipelineMonitor(spec(), T, clock)
    for wid in ("w1", "w2"):
        monitor.on_message(metrics({"component": "worker", "id": wid, "pipeline": "p"}))
    monitor.on_message(metrics({"component": "worker", "id": "w3", "pipeline": "other"}))
    assert monitor.snapshot().workers == ("w1", "w2")
    monitor.on_message(metrics({"component": "worker", "id": "w1", "state": "gone"}))
    assert monitor.snapshot().workers == ("w2",)
    clock.advance(HEARTBEAT_TIMEOUT_MS + 1)
    assert monitor.snapshot().workers == ()


def test_pool_workers_serving_the_pipeline_count_as_its_workers() -> None:
    monitor = PipelineMonitor(spec(), T, FakeClock())
    pool = {"component": "worker", "pipeline": None}
    monitor.on_message(metrics({**pool, "id": "pool-1", "serving": {"p": 3, "q": 1}}))
    monitor.on_message(metrics({**pool, "id": "pool-2", "serving": {"q": 1}}))
    snap = monitor.snapshot()
    assert snap.workers == ("pool-1",)
    assert snap.worker_metrics["pool-1"]["serving"] == {"p": 3, "q": 1}


def test_malformed_messages_are_ignored() -> None:
    monitor = PipelineMonitor(spec(), T, FakeClock())
    for topic in (T.gateway_status("g"), T.confirm("g", "p", 0), T.results("p"), T.late("p")):
        monitor.on_message(Message(topic, b"\xff not json"))
        monitor.on_message(Message(topic, b'{"unexpected": true}'))
    assert monitor.snapshot().lag_batches == 0


def test_signals_take_the_median_capacity_of_running_workers() -> None:
    clock = FakeClock()
    monitor = PipelineMonitor(spec(), T, clock)
    workers = [
        ("w1", "running", 100_000, 2.0, 40.0),
        ("w2", "running", 300_000, 3.0, 90.0),
        ("w3", "running", 200_000, 1.0, 10.0),
        ("w4", "draining", 1, 9.0, 99.0),
    ]
    for wid, state, capacity, bps, cpu in workers:
        body = {
            "component": "worker",
            "id": wid,
            "pipeline": "p",
            "state": state,
            "capacity_rows_per_s": capacity,
            "batches_per_s": bps,
            "cpu_percent": cpu,
        }
        monitor.on_message(metrics(body))
    sig = signals_from(monitor.snapshot(), 12.0, workers=3)
    assert sig.capacity_rows_per_s == 200_000
    assert sig.batches_per_s == 6.0
    assert sorted(sig.worker_cpu_percent) == [10.0, 40.0, 90.0]
    assert sig.workers == 3
