"""The spool: durable records, restart recovery, torn writes, capacity, the seq mark."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.errors import SpoolError
from shoal.gateway.spool import DiskSpool, MemorySpool, Spool, SpoolEntry

CT = "application/vnd.shoal.v1.binary+msgpack"


def record(seq: int, payload: bytes = b"", rows: int = 1) -> tuple[SpoolEntry, bytes]:
    payload = payload or f"payload-{seq}".encode()
    return SpoolEntry(seq, CT, rows, len(payload), 1_700_000_000_000 + seq), payload


@pytest.fixture(params=["disk", "memory"])
def spool(request, tmp_path) -> Spool:
    made = (
        DiskSpool(tmp_path / "spool", max_bytes=1000)
        if request.param == "disk"
        else (MemorySpool(max_bytes=1000))
    )
    yield made
    made.close()


def test_write_read_delete(spool: Spool) -> None:
    spool.put([record(0), record(1)])
    spool.put([record(2)])
    assert [e.seq for e in spool.entries()] == [0, 1, 2]
    assert spool.read(1) == b"payload-1"
    assert spool.get(2).sealed_at_ms == 1_700_000_000_002
    assert spool.bytes_used == 3 * len(b"payload-0")
    assert spool.rows_held == 3
    gone = spool.delete_through(1)
    assert [e.seq for e in gone] == [0, 1]
    assert [e.seq for e in spool.entries()] == [2]
    assert spool.high_water == 2
    with pytest.raises(SpoolError, match="no batch with seq 0"):
        spool.read(0)


def test_seqs_must_increase(spool: Spool) -> None:
    spool.put([record(5)])
    spool.delete_through(5)
    with pytest.raises(SpoolError, match="not above"):
        spool.put([record(5)])


def test_a_full_spool_refuses_all_of_a_put_and_says_so(spool: Spool) -> None:
    spool.put([record(0, b"x" * 600)])
    with pytest.raises(SpoolError, match="the spool is full") as info:
        spool.put([record(1, b"y" * 300), record(2, b"z" * 300)])
    assert "max_spool_bytes" in str(info.value)
    assert len(spool) == 1  # nothing of the refused put was written
    assert spool.high_water == 0
    spool.delete_through(0)
    spool.put([record(1, b"y" * 300), record(2, b"z" * 300)])
    assert len(spool) == 2


def test_replace_swaps_a_record_in_place(spool: Spool) -> None:
    spool.put([record(0, b"a" * 100), record(1)])
    spool.replace(SpoolEntry(0, CT, 0, 3, 5), b"nil")
    assert spool.read(0) == b"nil"
    assert spool.get(0).rows == 0
    assert spool.rows_held == 1
    assert spool.bytes_used == 3 + len(b"payload-1")


def test_restart_recovers_records_and_the_mark(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    first = DiskSpool(path)
    first.put([record(0), record(1), record(2, rows=7)])
    first.put([(SpoolEntry(3, CT, 4, 3, 9, resealed_from=(2, 0, 4)), b"abc")])
    first.delete_through(0)
    first.close()
    again = DiskSpool(path)
    assert [e.seq for e in again.entries()] == [1, 2, 3]
    assert again.get(2).rows == 7
    assert again.rows_held == 1 + 7 + 4
    assert again.get(3).resealed_from == (2, 0, 4)
    assert again.read(3) == b"abc"
    assert again.high_water == 3
    again.delete_through(3)
    again.close()
    # Everything confirmed and deleted: the mark still remembers seq 3.
    empty = DiskSpool(path)
    assert len(empty) == 0
    assert empty.high_water == 3
    empty.close()


def test_a_torn_temporary_file_is_ignored_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    spool = DiskSpool(path)
    spool.put([record(0)])
    spool.close()
    # A kill -9 in the middle of writing seq 1: half a record under the temporary name.
    complete = (path / f"{0:020d}.batch").read_bytes()
    (path / f"{1:020d}.batch.tmp").write_bytes(complete[: len(complete) // 2])
    (path / "seq.mark.tmp").write_bytes(b"")
    again = DiskSpool(path)
    assert [e.seq for e in again.entries()] == [0]
    assert again.high_water == 0
    assert not list(path.glob("*.tmp"))
    again.close()


def test_a_damaged_record_is_quarantined_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    spool = DiskSpool(path)
    spool.put([record(0), record(1), record(2)])
    spool.close()
    target = path / f"{1:020d}.batch"
    target.write_bytes(target.read_bytes()[:-3])  # what power loss without fsync can leave
    flipped = path / f"{2:020d}.batch"
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    again = DiskSpool(path)
    assert [e.seq for e in again.entries()] == [0]
    assert again.damaged == [1, 2]
    assert again.high_water == 2  # their seqs are still used
    assert (path / "corrupt" / target.name).exists()
    again.close()


def test_two_live_processes_cannot_share_a_spool(tmp_path: Path) -> None:
    first = DiskSpool(tmp_path / "spool")
    with pytest.raises(SpoolError, match="in use by another live gateway"):
        DiskSpool(tmp_path / "spool")
    first.close()
    DiskSpool(tmp_path / "spool").close()  # the lock went with the first


def test_fsync_mode_writes_the_same_records(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path / "spool", fsync=True)
    spool.put([record(0), record(1)])
    spool.close()
    again = DiskSpool(tmp_path / "spool", fsync=True)
    assert again.read(1) == b"payload-1"
    again.close()


def test_an_unwritable_folder_is_a_spool_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SpoolError, match="cannot open the spool folder"):
        DiskSpool(blocker / "spool")
