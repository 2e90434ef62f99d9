"""End-to-end delivery from a gateway through a real Mosquitto to a (test) confirmer:
kill -9 of the gateway, a broker crash, and a broker with a small packet limit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shoal._resources import resource_dir
from shoal._spawn import spawn_tied
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import PROTOCOL_OVERHEAD
from shoal.gateway import Gateway, GatewayConfig
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.integration._gateway_support import Confirmer, Received, stop_process

SCRIPT = Path(__file__).with_name("_gateway_proc.py")
STREAM = "plant"


def _check_sequence(got: Received) -> None:
    """Seqs 0..max all received, duplicates identical, no row under two seqs."""
    assert got.mismatched == [], "a seq was delivered twice with different rows"
    seqs = sorted(got.rows)
    assert seqs == list(range(len(seqs))), "seq numbers have a gap"
    values = np.concatenate([got.rows[s] for s in seqs])
    assert len(np.unique(values)) == len(values), "a row arrived under two different seqs"


def _start_gateway_proc(
    broker: EmbeddedBroker, topics: Topics, spool: Path, incarnation: int, chunks: int
) -> tuple[subprocess.Popen[str], list[str]]:
    with (spool.parent / f"gateway-{incarnation}.stderr").open("w") as stderr:
        proc = spawn_tied(
            [
                sys.executable,
                str(SCRIPT),
                f"--port={broker.port}",
                f"--root={topics.root}",
                f"--stream={STREAM}",
                "--gateway=gw-kill",
                f"--spool={spool}",
                f"--incarnation={incarnation}",
                f"--chunks={chunks}",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,  # a file: the child never blocks on a pipe nobody reads
            text=True,
        )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def test_kill_9_gateway_mid_stream_loses_nothing(broker, topics, tmp_path) -> None:
    spool = tmp_path / "spool"
    sealed: set[tuple[int, int]] = set()
    unreported: set[tuple[int, int]] = set()
    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        for incarnation in (0, 1):
            proc, lines = _start_gateway_proc(broker, topics, spool, incarnation, chunks=0)
            try:
                deadline = time.monotonic() + 10
                while len(lines) < 80 and time.monotonic() < deadline:
                    time.sleep(0.01)
                proc.kill()  # SIGKILL, mid-stream: flushes and publishes are under way
                proc.wait()
            finally:
                stop_process(proc)
            chunks = [int(line.split()[2]) for line in list(lines) if line.startswith("sealed")]
            assert len(chunks) >= 80, (tmp_path / f"gateway-{incarnation}.stderr").read_text()
            sealed.update((incarnation, c) for c in chunks)
            # The chunk being flushed at the kill may or may not have reached the spool.
            unreported.add((incarnation, max(chunks) + 1))
        proc, lines = _start_gateway_proc(broker, topics, spool, 2, chunks=40)
        try:
            assert proc.wait(30) == 0, (tmp_path / "gateway-2.stderr").read_text()
        finally:
            stop_process(proc)
        closed = next(line for line in lines if line.startswith("closed"))
        next_seq = int(closed.split()[2])
        sealed.update((2, c) for c in range(40))
        assert confirmer.wait_contiguous("gw-kill", next_seq - 1, 10)
        got = confirmer.snapshot("gw-kill")

    assert closed.startswith("closed True")
    _check_sequence(got)
    assert max(got.rows) == next_seq - 1
    # Each batch is one chunk of 100 rows: value // 100 names (incarnation, chunk).
    received = {
        (int(v[0]) // 1_000_000_000, int(v[0]) % 1_000_000_000 // 100): v for v in got.rows.values()
    }
    assert len(received) == len(got.rows)  # one chunk per seq
    assert sealed <= set(received), "a batch that was in the spool never arrived"
    assert set(received) - sealed <= unreported
    # Seqs continue across restarts: every batch of a later incarnation has a higher seq.
    by_seq = sorted(got.rows.items())
    incarnations = [int(values[0]) // 1_000_000_000 for _, values in by_seq]
    assert incarnations == sorted(incarnations)
    for values in got.rows.values():
        assert len(values) == 100


def _produce(gateway: Gateway, stop: threading.Event, sent: list[np.ndarray]) -> None:
    """Add 100-row chunks of unique values until stopped, one flushed batch each."""
    sensors = np.array([f"s{i}" for i in range(10)])
    chunk = 0
    while not stop.is_set():
        index = chunk * 100 + np.arange(100)
        gateway.add_many(sensors[index % 10], np.full(100, int(time.time() * 1000)), index * 1.0)
        gateway.flush()
        sent.append(index * 1.0)
        chunk += 1
        time.sleep(0.005)


def test_broker_crash_and_restart_mid_stream_loses_nothing(broker, topics, tmp_path) -> None:
    config = GatewayConfig(
        "gw-crash",
        stream=STREAM,
        broker=broker.settings,
        topics=topics,
        spool_dir=tmp_path / "spool",
        resend_after_ms=300,
        resend_window=64,
    )
    sent: list[np.ndarray] = []
    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        gateway = Gateway(config).start()
        stop = threading.Event()
        producer = threading.Thread(target=_produce, args=(gateway, stop, sent))
        producer.start()
        try:
            time.sleep(0.8)
            sealed_before_crash = len(sent)
            broker.kill()  # SIGKILL: whatever the broker held since its last save is gone
            time.sleep(0.3)
            broker.start()  # same port
            time.sleep(1.5)
        finally:
            stop.set()
            producer.join()
        assert gateway.close(timeout_s=15)
        stats = gateway.stats()
        assert confirmer.wait_contiguous("gw-crash", stats.next_seq - 1, 5)
        got = confirmer.snapshot("gw-crash")

    _check_sequence(got)
    assert max(got.rows) == stats.next_seq - 1
    sent_values = np.sort(np.concatenate(sent))
    received = np.sort(np.concatenate(list(got.rows.values())))
    np.testing.assert_array_equal(received, sent_values)
    assert stats.rows_sealed == len(sent_values)
    assert stats.spool_batches == 0
    assert len(sent) > sealed_before_crash > 0  # batches were sealed on both sides of it


@pytest.fixture
def small_packet_broker(tmp_path) -> EmbeddedBroker:
    """A broker whose max_packet_size is 32 KiB (the dev profile, overridden)."""
    assert "max_packet_size 16777216" in (resource_dir("broker") / "dev.conf").read_text()
    broker = EmbeddedBroker(
        "dev", data_dir=tmp_path / "data", overrides={"max_packet_size": "32768"}
    )
    broker.start()
    yield broker
    broker.close()


def test_small_packet_limit_splits_and_never_sends_oversize(small_packet_broker, topics) -> None:
    broker = small_packet_broker
    limit = 32768
    config = GatewayConfig(
        "gw-small",
        stream=STREAM,
        broker=broker.settings,
        topics=topics,
        encoding=Encoding.JSON_ROWS,  # ~60 bytes a row: 4,000 rows are far over 32 KiB
        batch_size=4000,
    )
    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        gateway = Gateway(config)
        # Sealed before the CONNACK tells the limit: batches fit 8 MiB, not 32 KiB.
        index = np.arange(8000)
        gateway.add_many(
            np.array([f"sensor-{i % 50}" for i in range(8000)]),
            np.full(8000, 1_700_000_000_000) + index,
            index * 0.5,
            unit="degC",
        )
        before = gateway.stats()
        assert before.batches_sealed == 2
        assert before.splits == 0
        gateway.start()
        # Sealed after it: split at seal time.
        gateway.add_many(
            np.array([f"sensor-{i % 50}" for i in range(8000)]),
            np.full(8000, 1_700_000_100_000) + index,
            index + 10_000.0,
        )
        assert gateway.close(timeout_s=15)
        stats = gateway.stats()
        confirmer.wait_contiguous("gw-small", stats.next_seq - 1, 5)
        got = confirmer.snapshot("gw-small")

    _check_sequence(got)
    overhead = len(config.ingest_topic) + PROTOCOL_OVERHEAD
    assert max(confirmer.payload_sizes) + overhead <= limit
    assert confirmer.content_types == {Encoding.JSON_ROWS.content_type}
    assert stats.splits > 0
    # The two early batches were re-sealed: their seqs 0 and 1 arrive as empty batches.
    assert len(got.rows[0]) == 0
    assert len(got.rows[1]) == 0
    received = np.sort(np.concatenate(list(got.rows.values())))
    expected = np.sort(np.concatenate([index * 0.5, index + 10_000.0]))
    np.testing.assert_array_equal(received, expected)
    log = broker.log_path.read_text()
    assert "too large" not in log.lower()
