"""The archive writer: partition files, atomic rollover, dedup, and readers that see it all."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import polars as pl
import pytest

from shoal.archive import ArchiveWriter, RolloverPolicy, data_files, read_batches, read_results
from shoal.archive.layout import HOUR_MS
from shoal.archive.writer import write_parquet_atomically
from shoal.schemas import Encoding, encode_batch
from tests.unit.archive.conftest import T0


def payload(gateway: str, seq: int) -> bytes:
    frame = pl.DataFrame({"sensor_id": ["s1", "s2"], "ts": [T0, T0 + 1], "value": [1.0, 2.0]})
    return encode_batch(
        frame, gateway_id=gateway, seq=seq, sent_at_ms=T0, encoding=Encoding.JSON_ROWS
    )


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_results_and_batches_land_in_their_partitions(tmp_path: Path, make_message) -> None:
    writer = ArchiveWriter(tmp_path, writer_id="w")
    assert writer.add_results(make_message(start=T0), T0 + 20_000) is False
    assert writer.add_results(make_message(start=T0 + HOUR_MS), T0 + HOUR_MS) is False
    writer.add_batch("sim", "ingest/sim/gw1", payload("gw1", 7), "application/json", T0)
    writer.add_batch("sim", "ingest/sim/gw1", b"junk", None, T0 + 1)
    written = writer.flush()
    assert len(written) == 3
    assert writer.stats.files == 3
    assert writer.buffers.bytes == 0
    assert writer.in_flight_bytes == 0
    names = sorted(str(p.relative_to(tmp_path)) for p in data_files(tmp_path, "results"))
    assert names[0].startswith("results/pipeline=p/date=2023-11-14/hour=22/part-")
    assert names[1].startswith("results/pipeline=p/date=2023-11-14/hour=23/part-")
    assert not list(tmp_path.rglob("*.tmp"))

    batches = read_batches(tmp_path)
    assert batches.columns == [
        "stream",
        "received_at",
        "topic",
        "gateway_id",
        "seq",
        "content_type",
        "payload",
    ]
    assert batches["gateway_id"].to_list() == ["gw1", None]
    assert batches["seq"].to_list() == [7, None]
    assert batches["payload"][0] == payload("gw1", 7)  # the exact bytes

    results = read_results(tmp_path, "p")
    assert results.height == 4
    assert results["pipeline"].unique().to_list() == ["p"]
    assert results.schema["count"] == pl.Int64
    assert results.schema["stddev"] == pl.Float64
    assert read_results(tmp_path, "p", start_ms=T0 + HOUR_MS).height == 2
    assert read_results(tmp_path, "p", end_ms=T0 + 10_000).height == 2
    assert read_results(tmp_path, "nope").height == 0


def test_duplicate_windows_are_archived_once(tmp_path: Path, make_message) -> None:
    writer = ArchiveWriter(tmp_path, writer_id="a")
    writer.add_results(make_message(), T0)
    writer.add_results(make_message(), T0 + 1)  # re-published after a combiner restart
    writer.add_results(make_message(revision=2, scale=2.0), T0 + 2)  # a new revision is new
    assert writer.stats.duplicate_results == 1
    writer.flush()
    # a second archiver (or a restart) that saw the same message: readers drop the copy
    other = ArchiveWriter(tmp_path, writer_id="b")
    other.add_results(make_message(), T0 + 3)
    other.flush()
    results = read_results(tmp_path, all_revisions=True)
    assert results.height == 4
    assert sorted(results["revision"].to_list()) == [1, 1, 2, 2]
    assert read_results(tmp_path)["revision"].to_list() == [2, 2]  # the latest revision
    assert results.filter(pl.col("revision") == 1)["received_at"].to_list() == [T0, T0]


def test_rollover_by_rows_and_age(tmp_path: Path, make_message) -> None:
    clock = FakeMonotonic()
    policy = RolloverPolicy(max_rows=4, max_age_s=10)
    writer = ArchiveWriter(tmp_path, policy, writer_id="w", monotonic=clock)
    writer.add_results(make_message(start=T0), T0)
    assert writer.take_due() == []
    assert writer.add_results(make_message(start=T0 + 10_000), T0) is True  # 4 rows
    jobs = writer.take_due()
    assert [job.frame.height for job in jobs] == [4]
    assert writer.in_flight_bytes == jobs[0].bytes > 0
    writer.done(jobs[0], writer.write_job(jobs[0]))
    assert writer.in_flight_bytes == 0
    writer.add_results(make_message(start=T0 + 20_000), T0)
    clock.now = 9.9
    assert writer.take_due() == []
    clock.now = 10.0
    assert len(writer.take_due()) == 1


def test_half_written_files_are_never_visible(tmp_path: Path, monkeypatch, make_message) -> None:
    target = tmp_path / "results" / "pipeline=p" / "date=2023-11-14" / "hour=22" / "part-x.parquet"
    original = pl.DataFrame.write_parquet
    seen_while_writing = []

    def slow_write(self, file, **kwargs):
        original(self, file, **kwargs)
        seen_while_writing.append(data_files(tmp_path, "results"))

    monkeypatch.setattr(pl.DataFrame, "write_parquet", slow_write)
    write_parquet_atomically(make_message().frame, target, "zstd")
    assert seen_while_writing == [[]]  # the temporary file exists but is not listed
    assert data_files(tmp_path, "results") == [target]

    def crash(self, file, **kwargs):
        Path(file).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", crash)
    with pytest.raises(OSError, match="disk full"):
        write_parquet_atomically(make_message().frame, target.with_name("part-y.parquet"), "zstd")
    assert data_files(tmp_path, "results") == [target]
    assert list(tmp_path.rglob("*.tmp")) == []


def test_plain_polars_and_pandas_read_the_folders(tmp_path: Path, make_message) -> None:
    writer = ArchiveWriter(tmp_path)
    writer.add_results(make_message(pipeline="p1"), T0)
    writer.add_results(make_message(pipeline="p2", keys=("c",)), T0)
    writer.flush()
    lazy = pl.scan_parquet(tmp_path / "results" / "**" / "*.parquet", hive_partitioning=True)
    frame = lazy.collect()
    assert frame.height == 3
    assert sorted(frame["pipeline"].unique().to_list()) == ["p1", "p2"]
    table = pd.read_parquet(tmp_path / "results")
    assert len(table) == 3
    assert sorted(table["pipeline"].astype(str).unique()) == ["p1", "p2"]


def test_read_results_takes_the_latest_revision(tmp_path: Path, make_message) -> None:
    writer = ArchiveWriter(tmp_path, writer_id="w")
    writer.add_results(make_message(keys=("a", "b")), T0 + 20_000)
    writer.add_results(make_message(revision=2, keys=("a", "b", "c"), scale=2.0), T0 + 21_000)
    writer.add_results(make_message(keys=("a", "b")), T0 + 22_000)  # re-published after a restart
    writer.flush()
    latest = read_results(tmp_path)
    assert latest.select("key", "revision").rows() == [("a", 2), ("b", 2), ("c", 2)]
    every = read_results(tmp_path, all_revisions=True)
    assert sorted(every["revision"].to_list()) == [1, 1, 2, 2, 2]
