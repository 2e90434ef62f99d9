"""Partition folders and file names: hive-style, hour boundaries, escaping, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.archive.layout import (
    HOUR_MS,
    data_files,
    file_name,
    hour_of_partition,
    hour_start,
    partition_dir,
    partition_values,
    temp_path,
)

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z
HOUR_22 = 1_699_999_200_000  # 2023-11-14T22:00:00Z


@pytest.mark.parametrize(
    ("ms", "expected"),
    [
        (T0, HOUR_22),
        (HOUR_22, HOUR_22),
        (HOUR_22 - 1, HOUR_22 - HOUR_MS),
        (HOUR_22 + HOUR_MS - 1, HOUR_22),
        (0, 0),
    ],
)
def test_hour_start_is_the_utc_hour(ms: int, expected: int) -> None:
    assert hour_start(ms) == expected


def test_partition_dir_is_hive_style(tmp_path: Path) -> None:
    assert partition_dir(tmp_path, "results", "default", T0) == (
        tmp_path / "results" / "pipeline=default" / "date=2023-11-14" / "hour=22"
    )
    assert partition_dir(tmp_path, "batches", "sim", HOUR_22 + HOUR_MS * 2) == (
        tmp_path / "batches" / "stream=sim" / "date=2023-11-15" / "hour=00"
    )


def test_names_that_are_not_path_safe_are_escaped(tmp_path: Path) -> None:
    folder = partition_dir(tmp_path, "batches", "../a/b c", T0)
    assert folder.parent.parent.name == "stream=%2E.%2Fa%2Fb%20c"
    assert folder.is_relative_to(tmp_path / "batches")
    path = folder / "part.parquet"
    assert partition_values(path, tmp_path / "batches")["stream"] == "../a/b c"


def test_file_names_sort_by_time_and_do_not_collide() -> None:
    a = file_name("w1", 1, T0)
    b = file_name("w1", 2, T0)
    c = file_name("w2", 1, T0 + 1_000)
    assert a == "part-20231114T221320Z-w1-000001.parquet"
    assert len({a, b, c}) == 3
    assert sorted([c, b, a]) == [a, b, c]


def test_temp_files_are_hidden(tmp_path: Path) -> None:
    final = tmp_path / "x" / "part-1.parquet"
    assert temp_path(final) == tmp_path / "x" / ".part-1.parquet.tmp"


def test_data_files_lists_finished_files_and_prunes_hours(tmp_path: Path) -> None:
    for hour in (0, 1, 2):
        folder = partition_dir(tmp_path, "results", "p", HOUR_22 + hour * HOUR_MS)
        folder.mkdir(parents=True)
        (folder / f"part-{hour}.parquet").write_bytes(b"x")
        (folder / f".part-{hour}.parquet.tmp").write_bytes(b"half")
    other = partition_dir(tmp_path, "results", "q", HOUR_22)
    other.mkdir(parents=True)
    (other / "part-q.parquet").write_bytes(b"x")
    assert [p.name for p in data_files(tmp_path, "results", "p")] == [
        "part-0.parquet",
        "part-1.parquet",
        "part-2.parquet",
    ]
    assert len(data_files(tmp_path, "results")) == 4
    pruned = data_files(
        tmp_path, "results", "p", start_ms=HOUR_22 + HOUR_MS, end_ms=HOUR_22 + 2 * HOUR_MS
    )
    assert [p.name for p in pruned] == ["part-1.parquet"]
    assert data_files(tmp_path, "batches") == []
    assert data_files(tmp_path / "missing", "results", "p") == []


def test_hour_of_partition_round_trips() -> None:
    assert hour_of_partition({"date": "2023-11-14", "hour": "22"}) == HOUR_22
    assert hour_of_partition({"date": "bad", "hour": "22"}) is None
    assert hour_of_partition({}) is None
