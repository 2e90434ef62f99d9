"""Read an archive back: raw batches and deduplicated window results as polars frames.

Plain polars or pandas read the folders too (``pl.scan_parquet(root / "results",
hive_partitioning=True)``, ``pandas.read_parquet(root / "results")``); these functions add
time-range pruning on the hour folders, typed partition columns, and, for results, the
deduplication on ``(pipeline, window, start, partition, revision, key)`` that a re-published
window needs.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from shoal.archive.layout import HOUR_MS, Kind, data_files, partition_values
from shoal.archive.records import BATCH_SCHEMA
from shoal.schemas.results import ROW_IDENTITY, empty_results, latest_revisions


def _read(root: Path, kind: Kind, files: list[Path], name_column: str) -> pl.DataFrame | None:
    frames = []
    for path in files:
        values = partition_values(path, root / kind)
        frames.append(
            pl.read_parquet(path).with_columns(
                pl.lit(values.get(name_column), dtype=pl.String).alias(name_column)
            )
        )
    if not frames:
        return None
    return pl.concat(frames, how="diagonal_relaxed")


def read_batches(
    root: Path,
    stream: str | None = None,
    *,
    start_ms: int | None = None,
    end_ms: int | None = None,
) -> pl.DataFrame:
    """Archived raw batches received in ``[start_ms, end_ms)``, in receive order.

    Columns: ``stream`` and ``BATCH_SCHEMA`` (``received_at``, ``topic``, ``gateway_id``,
    ``seq``, ``content_type``, ``payload``). Re-sent batches appear as often as the broker
    delivered them; replay deduplicates on ``(gateway_id, seq)``.
    """
    files = data_files(root, "batches", stream, start_ms=start_ms, end_ms=end_ms)
    frame = _read(root, "batches", files, "stream")
    if frame is None:
        return pl.DataFrame(schema={"stream": pl.String(), **BATCH_SCHEMA})
    if start_ms is not None:
        frame = frame.filter(pl.col("received_at") >= start_ms)
    if end_ms is not None:
        frame = frame.filter(pl.col("received_at") < end_ms)
    columns = ["stream", *BATCH_SCHEMA.names()]
    return frame.select(columns).sort("received_at", maintain_order=True)


def read_results(
    root: Path,
    pipeline: str | None = None,
    *,
    start_ms: int | None = None,
    end_ms: int | None = None,
    window: str | None = None,
    all_revisions: bool = False,
) -> pl.DataFrame:
    """Archived window results (each row once), windows inside ``[start_ms, end_ms)``.

    Rows are in the result layout (``shoal.schemas.results``) plus ``received_at``, sorted by
    window end, window, start and key. A window re-published after a combiner restart is
    kept once (the first copy received). Of a corrected window only the latest revision is
    kept (``latest_revisions``) unless ``all_revisions``.
    """
    # Results are filed under their window's start hour, so a window ending at end_ms
    # started at most its size earlier; prune on start only.
    files = data_files(
        root,
        "results",
        pipeline,
        start_ms=start_ms,
        end_ms=None if end_ms is None else end_ms + HOUR_MS,
    )
    frame = _read(root, "results", files, "pipeline")
    if frame is None:
        return empty_results().with_columns(pl.lit(None, dtype=pl.Int64).alias("received_at"))
    if start_ms is not None:
        frame = frame.filter(pl.col("start") >= start_ms)
    if end_ms is not None:
        frame = frame.filter(pl.col("end") <= end_ms)
    if window is not None:
        frame = frame.filter(pl.col("window") == window)
    head = [c for c in empty_results().columns if c in frame.columns]
    rest = [c for c in frame.columns if c not in head]
    unique = (
        frame.select(*head, *rest)
        .sort("received_at", maintain_order=True)
        .unique(subset=list(ROW_IDENTITY), keep="first", maintain_order=True)
    )
    if not all_revisions:
        unique = latest_revisions(unique)
    return unique.sort("end", "window", "start", "key", nulls_last=True)
