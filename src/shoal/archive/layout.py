"""Where archive files live: hive-style partition folders and file names (pure).

::

    <root>/results/pipeline=<pipeline>/date=YYYY-MM-DD/hour=HH/part-<...>.parquet
    <root>/batches/stream=<stream>/date=YYYY-MM-DD/hour=HH/part-<...>.parquet

Results are partitioned by the UTC hour of the window's ``start`` (event time), raw batches by
the UTC hour in which the archive received them. File names are
``part-<YYYYmmddTHHMMSSZ>-<writer>-<n>.parquet`` (first row's time, writer id, counter), so
several archivers and restarts never collide. A file is written under a hidden temporary name
(``.<name>.tmp``) and renamed into place: readers list only ``*.parquet`` files without a
leading dot and so never see a half-written file. polars (``hive_partitioning=True``),
pyarrow and pandas read the folders directly; the partition values are not repeated inside
the files.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Final, Literal
from urllib.parse import quote, unquote

Kind = Literal["results", "batches"]

HOUR_MS: Final = 3_600_000
PARTITION_KEY: Final[dict[Kind, str]] = {"results": "pipeline", "batches": "stream"}
"""The first partition column of each kind of data."""


def hour_start(ms: int) -> int:
    """Start of the UTC hour containing ``ms`` (epoch milliseconds)."""
    return ms - ms % HOUR_MS


def _escape(name: str) -> str:
    text = quote(name, safe="")
    return "%2E" + text[1:] if text.startswith(".") else text


def partition_dir(root: Path, kind: Kind, name: str, at_ms: int) -> Path:
    """The folder of ``kind`` data of one pipeline (results) or stream (batches) and hour."""
    when = dt.datetime.fromtimestamp(hour_start(at_ms) / 1000, tz=dt.UTC)
    return (
        root
        / kind
        / f"{PARTITION_KEY[kind]}={_escape(name)}"
        / f"date={when:%Y-%m-%d}"
        / f"hour={when:%H}"
    )


def file_name(writer_id: str, counter: int, first_ms: int) -> str:
    """The final name of a part file (unique per writer and counter)."""
    when = dt.datetime.fromtimestamp(first_ms / 1000, tz=dt.UTC)
    return f"part-{when:%Y%m%dT%H%M%S}Z-{writer_id}-{counter:06d}.parquet"


def temp_path(final: Path) -> Path:
    """The hidden name a part file is written under before its atomic rename."""
    return final.with_name(f".{final.name}.tmp")


def partition_values(path: Path, root: Path) -> dict[str, str]:
    """``key=value`` folders between ``root`` and ``path`` (values unescaped)."""
    out = {}
    for part in path.relative_to(root).parts[:-1]:
        key, sep, value = part.partition("=")
        if sep:
            out[key] = unquote(value)
    return out


def hour_of_partition(values: dict[str, str]) -> int | None:
    """Epoch ms of the hour a partition folder holds (None: not a dated folder)."""
    try:
        day = dt.datetime.strptime(values["date"], "%Y-%m-%d").replace(tzinfo=dt.UTC)
        return int(day.timestamp() * 1000) + int(values["hour"]) * HOUR_MS
    except (KeyError, ValueError):
        return None


def data_files(
    root: Path,
    kind: Kind,
    name: str | None = None,
    *,
    start_ms: int | None = None,
    end_ms: int | None = None,
) -> list[Path]:
    """Finished part files of ``kind`` (one pipeline or stream, or all), sorted.

    ``start_ms``/``end_ms`` keep only hour folders that can hold times in
    ``[start_ms, end_ms)``. Temporary and hidden files are never listed.
    """
    base = root / kind
    if name is not None:
        base = base / f"{PARTITION_KEY[kind]}={_escape(name)}"
    if not base.is_dir():
        return []
    out = []
    for path in base.rglob("*.parquet"):
        if path.name.startswith("."):
            continue
        hour = hour_of_partition(partition_values(path, root / kind))
        if hour is not None:
            if start_ms is not None and hour + HOUR_MS <= start_ms:
                continue
            if end_ms is not None and hour >= end_ms:
                continue
        out.append(path)
    return sorted(out)
