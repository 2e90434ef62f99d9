"""Generated data sets for exactness tests: gateways, batches, late rows, gaps, duplicates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.schemas import FRAME_SCHEMA


@dataclass(frozen=True)
class GeneratedBatch:
    """One batch as a gateway would send it."""

    gateway_id: str
    seq: int
    frame: pl.DataFrame  # FRAME_SCHEMA


def frame_of(rows: list[tuple[str, int, float]]) -> pl.DataFrame:
    """A decoded batch (``FRAME_SCHEMA``) of ``(sensor_id, ts, value)`` rows."""
    return pl.DataFrame(
        {
            "sensor_id": [r[0] for r in rows],
            "ts": [r[1] for r in rows],
            "value": [r[2] for r in rows],
            "name": None,
            "type": None,
            "unit": None,
        },
        schema=FRAME_SCHEMA,
    )


def make_batches(
    *,
    seed: int,
    gateways: int = 3,
    batches_per_gateway: int = 12,
    rows_per_batch: tuple[int, int] = (0, 40),
    keys: int = 6,
    start_ms: int = 1_700_000_000_000,
    step_ms: int = 700,
    late_fraction: float = 0.1,
    late_by_ms: tuple[int, int] = (500, 20_000),
    gap_every: int = 0,
    first_seq: int = 0,
) -> list[GeneratedBatch]:
    """Batches whose timestamps mostly advance, with some rows far behind (late candidates).

    ``gap_every`` > 0 leaves a silent stretch in event time every that many batches.
    """
    rng = np.random.default_rng(seed)
    out: list[GeneratedBatch] = []
    for g in range(gateways):
        gateway_id = f"gw{g}"
        clock = start_ms + int(rng.integers(0, step_ms))
        for b in range(batches_per_gateway):
            n = int(rng.integers(rows_per_batch[0], rows_per_batch[1] + 1))
            ts = clock + np.sort(rng.integers(0, step_ms, n))
            late = rng.random(n) < late_fraction
            ts = np.where(late, ts - rng.integers(late_by_ms[0], late_by_ms[1] + 1, n), ts)
            ts = np.maximum(ts, 0)
            values = np.round(rng.normal(20.0, 8.0, n), 3)
            key_ids = rng.integers(0, keys, n)
            frame = pl.DataFrame(
                {
                    "sensor_id": [
                        f"{gateway_id}-k{k}" if k % 2 else f"shared-k{k}" for k in key_ids
                    ],
                    "ts": ts.astype(np.int64),
                    "value": values.astype(np.float64),
                    "name": None,
                    "type": None,
                    "unit": None,
                },
                schema=FRAME_SCHEMA,
            )
            out.append(GeneratedBatch(gateway_id, first_seq + b, frame))
            clock += step_ms
            if gap_every and (b + 1) % gap_every == 0:
                clock += 5 * step_ms
    return out


def all_rows(batches: list[GeneratedBatch], key: str = "sensor_id") -> pl.DataFrame:
    """Every row once, with gateway_id and seq, keyed like the pipeline (for the oracle)."""
    frames = [
        b.frame.select(pl.col(key).alias("key"), "ts", "value").with_columns(
            gateway_id=pl.lit(b.gateway_id),
            seq=pl.lit(b.seq, dtype=pl.Int64),
            row=pl.int_range(pl.len(), dtype=pl.Int64),  # within the batch: count windows
        )
        for b in batches
    ]
    return pl.concat(frames)


def make_spec(
    name: str,
    windows: Sequence[dict[str, Any]],
    aggregates: Sequence[str],
    partitions: int = 1,
    **settings: Any,
) -> PipelineSpec:
    """A pipeline over ``make_batches`` data with these ``windows``.

    Lateness 1 s, idle timeout 1.5 s and no future-timestamp limit (the data set lies in
    2023) unless ``settings`` (further top-level spec keys) say otherwise.
    """
    return parse_pipeline(
        {
            "name": name,
            "windows": list(windows),
            "aggregates": list(aggregates),
            "partitions": partitions,
            "lateness_ms": 1_000,
            "idle_timeout_ms": 1_500,
            "limits": {"max_future_ms": False},
            **settings,
        }
    )


def two_window_spec(
    name: str, aggregates: Sequence[str], partitions: int = 1, **settings: Any
) -> PipelineSpec:
    """``make_spec`` with a tumbling 2 s and a hopping 4 s / 2 s window."""
    windows = [
        {"kind": "tumbling", "size_ms": 2_000},
        {"kind": "hopping", "size_ms": 4_000, "slide_ms": 2_000},
    ]
    return make_spec(name, windows, aggregates, partitions, **settings)
