"""The gateway without a broker: input checks, sealing, seq recovery, spool repair."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import shoal.gateway
from shoal.clock import FakeClock
from shoal.errors import ConfigError, PayloadTooLargeError, SchemaError, SpoolError
from shoal.gateway import DiskSpool, Gateway, GatewayConfig, SpoolEntry
from shoal.loadtest.data import synthetic_block
from shoal.schemas import Encoding, decode_batch, encode_batch

NOW = 1_700_000_000_000


def make(tmp_path: Path, **overrides) -> tuple[Gateway, FakeClock]:
    clock = FakeClock(NOW)
    settings = {"spool_dir": tmp_path / "spool", "batch_size": 100, **overrides}
    return Gateway(GatewayConfig("gw", **settings), clock), clock


def spooled(path: Path) -> dict[int, int]:
    """seq -> rows of every record, checking each payload carries its own seq."""
    spool = DiskSpool(path)
    try:
        out = {}
        for entry in spool.entries():
            batch = decode_batch(spool.read(entry.seq), content_type=entry.content_type)
            assert batch.envelope.seq == entry.seq
            assert batch.envelope.rows == entry.rows
            out[entry.seq] = entry.rows
        return out
    finally:
        spool.close()


def test_public_surface_is_pinned() -> None:
    assert sorted(shoal.gateway.__all__) == [
        "DiskSpool",
        "Gateway",
        "GatewayConfig",
        "GatewayStats",
        "MemorySpool",
        "Spool",
        "SpoolEntry",
    ]


def test_seqs_start_at_zero_and_continue_across_restarts_without_reuse(tmp_path) -> None:
    gateway, _ = make(tmp_path)
    gateway.add_block(synthetic_block(250, start_ms=NOW - 60_000))
    gateway.flush()
    assert gateway.stats().next_seq == 3
    gateway.close(0)
    assert spooled(tmp_path / "spool") == {0: 100, 1: 100, 2: 50}

    # The pipeline confirmed everything: records deleted, the mark remembers.
    spool = DiskSpool(tmp_path / "spool")
    spool.delete_through(2)
    spool.close()
    gateway, _ = make(tmp_path)
    assert gateway.stats().next_seq == 3
    assert gateway.stats().confirmed_seq == 2
    gateway.add_block(synthetic_block(100, start_ms=NOW - 60_000))
    gateway.close(0)
    assert spooled(tmp_path / "spool") == {3: 100}

    # A crash after the record was written but before the mark moved: the record wins.
    (tmp_path / "spool" / "seq.mark").write_text("1\n")
    gateway, _ = make(tmp_path)
    assert gateway.stats().next_seq == 4
    assert gateway.stats().confirmed_seq == 2
    gateway.close(0)

    # A crash in the middle of writing a record: the torn temporary file burns no seq.
    (tmp_path / "spool" / f"{4:020d}.batch.tmp").write_bytes(b"SHOALSP1\x00")
    gateway, _ = make(tmp_path)
    assert gateway.stats().next_seq == 4
    gateway.close(0)


def test_a_missing_or_damaged_record_becomes_an_empty_batch(tmp_path, caplog) -> None:
    gateway, _ = make(tmp_path)
    gateway.add_block(synthetic_block(400, start_ms=NOW - 60_000))
    gateway.close(0)
    (tmp_path / "spool" / f"{1:020d}.batch").unlink()
    damaged = tmp_path / "spool" / f"{2:020d}.batch"
    damaged.write_bytes(damaged.read_bytes()[:50])
    with caplog.at_level(logging.ERROR):
        gateway, _ = make(tmp_path)
    assert "are missing or damaged" in caplog.text
    gateway.close(0)
    assert spooled(tmp_path / "spool") == {0: 100, 1: 0, 2: 0, 3: 100}


def test_an_interrupted_reseal_is_finished_on_start(tmp_path) -> None:
    gateway, _ = make(tmp_path)
    block = synthetic_block(100, start_ms=NOW - 60_000)
    gateway.add_block(block)
    gateway.close(0)
    # A re-seal wrote its first part (rows 0..40 of seq 0, as seq 1), then the process died.
    payload = encode_batch(
        block.slice(0, 40),
        gateway_id="gw",
        seq=1,
        sent_at_ms=NOW,
        encoding=Encoding.BINARY_COLUMNAR,
    )
    spool = DiskSpool(tmp_path / "spool")
    ct = Encoding.BINARY_COLUMNAR.content_type
    spool.put([(SpoolEntry(1, ct, 40, len(payload), NOW, (0, 0, 40)), payload)])
    spool.close()
    gateway, _ = make(tmp_path)
    gateway.close(0)
    assert spooled(tmp_path / "spool") == {0: 0, 1: 40, 2: 60}
    spool = DiskSpool(tmp_path / "spool")
    assert spool.get(2).resealed_from == (0, 40, 100)
    rest = decode_batch(spool.read(2)).frame.get_column("value").to_numpy()
    spool.close()
    np.testing.assert_array_equal(rest, block.value[40:])


def add_until_full(gateway: Gateway, block) -> int:
    accepted = 0
    for _ in range(1000):
        try:
            gateway.add_block(block)
        except SpoolError:
            return accepted
        accepted += len(block)
    raise AssertionError("the spool never filled")


def test_a_full_spool_refuses_rows_and_burns_no_seq(tmp_path) -> None:
    gateway, _ = make(tmp_path, max_spool_bytes=6000)
    block = synthetic_block(100, start_ms=NOW - 60_000)
    accepted = add_until_full(gateway, block)
    with pytest.raises(SpoolError, match="is full"):
        gateway.add_block(block)
    stats = gateway.stats()
    assert stats.rows_added == accepted
    assert stats.rejected == 200
    assert stats.rows_sealed + stats.rows_buffered == accepted
    with pytest.raises(SpoolError, match="is full"):
        gateway.flush()
    with pytest.raises(SpoolError, match="is full"):
        gateway.close(0)  # stops anyway; the buffered rows were never sealed
    assert sorted(spooled(tmp_path / "spool")) == list(range(stats.next_seq))


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda g: g.add("s", NOW, float("nan")), "not_finite"),
        (lambda g: g.add("s", -1, 1.0), "out_of_range"),
        (lambda g: g.add("s", 2**53, 1.0), "out_of_range"),
        (lambda g: g.add("s", True, 1.0), "bad_type"),
        (lambda g: g.add("s", NOW, True), "bad_type"),
        (lambda g: g.add("", NOW, 1.0), "empty_string"),
        (lambda g: g.add("x" * 257, NOW, 1.0), "string_too_long"),
        (lambda g: g.add("s", NOW, 1.0, unit=""), "empty_string"),
        (lambda g: g.add("s", NOW + 10 * 60_000, 1.0), "ts_in_future"),
        (lambda g: g.add_many(["a", "b"], [NOW, NOW], [1.0, np.inf]), "not_finite"),
        (lambda g: g.add_many(["a", "b"], [NOW, NOW], [1.0]), "length_mismatch"),
        (lambda g: g.add_many(["a", ""], [NOW, NOW], [1.0, 2.0]), "empty_string"),
        (lambda g: g.add_many(["a", None], [NOW, NOW], [1.0, 2.0]), "null_value"),
        (lambda g: g.add_many("a", np.array([NOW, -5]), np.zeros(2)), "out_of_range"),
        (lambda g: g.add_many("a", np.array([NOW + 0.5]), np.zeros(1)), "bad_type"),
        (lambda g: g.add_many("a", [NOW], ["1.0"]), "bad_type"),
        (lambda g: g.add_many("a", [NOW], [1.0], name=["é" * 200]), "string_too_long"),
    ],
)
def test_invalid_input_is_refused_at_add_time(tmp_path, call, reason) -> None:
    gateway, _ = make(tmp_path)
    with pytest.raises(SchemaError) as info:
        call(gateway)
    assert info.value.reason == reason
    stats = gateway.stats()
    assert stats.rows_added == 0
    assert stats.rejected > 0
    gateway.close(0)


def test_errors_name_the_row(tmp_path) -> None:
    gateway, _ = make(tmp_path)
    values = np.ones(10)
    values[7] = np.nan
    with pytest.raises(SchemaError, match="row 7"):
        gateway.add_many(np.array(["a"] * 10), np.full(10, NOW), values)
    gateway.close(0)


def test_add_add_many_and_add_block_agree(tmp_path) -> None:
    gateway, _ = make(tmp_path, batch_size=1000)
    gateway.add("s1", NOW, 1.5, name="temp", unit="C")
    gateway.add_many(np.array(["s2", "s3"]), np.array([NOW + 1, NOW + 2]), np.array([2, 3]))
    gateway.add_many(("s4",), [np.datetime64(NOW + 3, "ms")], [4.0], type="ntc")
    gateway.add_block(synthetic_block(3, start_ms=NOW))
    gateway.flush()
    gateway.close(0)
    spool = DiskSpool(tmp_path / "spool")
    frame = decode_batch(spool.read(0)).frame
    spool.close()
    assert frame.height == 7
    assert frame.get_column("sensor_id").to_list()[:4] == ["s1", "s2", "s3", "s4"]
    assert frame.get_column("ts").to_list()[:4] == [NOW, NOW + 1, NOW + 2, NOW + 3]
    assert frame.get_column("unit").to_list()[:4] == ["C", None, None, None]
    assert frame.get_column("type").to_list()[:4] == [None, None, None, "ntc"]


def test_a_partial_batch_is_sealed_by_age_in_poll(tmp_path) -> None:
    gateway, clock = make(tmp_path, max_delay_ms=500)
    gateway.add("s", NOW, 1.0)
    gateway.poll()
    assert gateway.stats().batches_sealed == 0
    clock.advance(500)
    gateway.poll()
    stats = gateway.stats()
    assert stats.batches_sealed == 1
    assert stats.rows_buffered == 0
    gateway.close(0)


def test_a_tiny_packet_limit_splits_and_a_measurement_too_large_is_refused(tmp_path) -> None:
    gateway, _ = make(tmp_path, max_packet_bytes=1024, batch_size=500, encoding=Encoding.JSON_ROWS)
    gateway.add_block(synthetic_block(500, start_ms=NOW - 60_000))
    stats = gateway.stats()
    assert stats.splits > 0
    assert stats.rows_sealed == 500
    big = "x" * 256
    gateway.add(big, NOW, 1.0, name=big, type=big, unit=big)
    gateway.add("small", NOW, 2.0)
    with pytest.raises(PayloadTooLargeError, match="do not fit a packet"):
        gateway.flush()
    stats = gateway.stats()
    assert stats.rejected == 1
    assert stats.rows_sealed == 501  # the small row went out alone
    gateway.close(0)
    spool = DiskSpool(tmp_path / "spool")
    sizes = [e.payload_bytes for e in spool.entries()]
    spool.close()
    assert len(sizes) == stats.batches_sealed
    assert max(sizes) <= gateway.config.payload_limit(None) < 1024


@pytest.mark.parametrize(
    "overrides",
    [
        {"gateway_id": "bad/id"},
        {"stream": ""},
        {"batch_size": 0},
        {"batch_size": 2_000_000},
        {"max_delay_ms": 0},
        {"max_packet_bytes": 100},
        {"zstd": True, "encoding": Encoding.JSON_ROWS},
        {"confirm_from": ("ok", "not ok")},
        {"max_inflight": 0},
        {"max_spool_bytes": -1},
    ],
)
def test_config_is_validated(overrides) -> None:
    settings = {"gateway_id": "gw", **overrides}
    with pytest.raises(ConfigError):
        GatewayConfig(**settings)
