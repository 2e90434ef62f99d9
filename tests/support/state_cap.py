"""A pipeline run past a low state cap (``[limits] max_state_cells``), checked end to end.

Shared by the in-memory test (1M keys) and the live one (real Mosquitto): distinct keys in
batches of one gateway, one batch per second of event time, 2 s tumbling windows, so each
window holds two batches' keys. Whatever the cap refuses must be in the dead letters whole;
whatever it accepted must be in the results exactly as polars computes it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import polars as pl
from polars.testing import assert_frame_equal

from shoal.broker.session import SessionFactory
from shoal.broker.settings import BrokerSettings
from shoal.processors.partials import Partial
from shoal.processors.spec import PipelineSpec
from shoal.schemas import FRAME_SCHEMA, Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import GeneratedBatch, all_rows, make_spec
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.oracle import closed_by, expected_results

T0 = 1_700_000_000_000


def keyed_frame(keys: list[str], ts: np.ndarray, values: np.ndarray) -> pl.DataFrame:
    """A decoded batch of these keys, times and values."""
    return pl.DataFrame(
        {"sensor_id": keys, "ts": ts, "value": values, "name": None, "type": None, "unit": None},
        schema=FRAME_SCHEMA,
    )


def capped_spec(name: str, cap: int) -> PipelineSpec:
    return make_spec(
        name,
        [{"kind": "tumbling", "size_ms": 2_000}],
        ["count", "mean", "min", "max"],
        limits={"max_state_cells": cap, "max_future_ms": False},
        checkpoint_interval_ms=200,
    )


def distinct_key_batches(count: int, per_batch: int, seed: int = 20) -> list[GeneratedBatch]:
    """``count`` batches of gateway g1, each of ``per_batch`` keys seen nowhere else."""
    rng = np.random.default_rng(seed)
    return [
        GeneratedBatch(
            "g1",
            seq,
            keyed_frame(
                [f"s{seq}-{i}" for i in range(per_batch)],
                T0 + seq * 1_000 + rng.integers(0, 1_000, per_batch),
                rng.normal(20.0, 5.0, per_batch),
            ),
        )
        for seq in range(count)
    ]


async def run_capped(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    settings: BrokerSettings,
    topics: Topics,
    state_dir: Path,
    session_factory: SessionFactory,
) -> tuple[pl.DataFrame, list[dict[str, Any]], int, dict[str, object]]:
    """Run the batches through one worker and one combiner: (results, dead letters,
    close threshold, the combiner's last heartbeat)."""
    pipeline = InProcessPipeline(
        spec, settings, topics, workers=1, state_dir=state_dir, session_factory=session_factory
    )
    async with collector(settings, topics, spec.name, session_factory=session_factory) as seen:
        await pipeline.start()
        await publish_batches(
            settings,
            topics,
            batches,
            list(range(len(batches))),
            encoding=Encoding.BINARY_COLUMNAR,
            session_factory=session_factory,
        )
        await pipeline.wait_applied({"g1": batches[-1].seq}, timeout_s=120)
        combiner = pipeline.combiners[0]
        for _ in range(200):
            if len(seen.deadletters) >= combiner.core.counters.partials_over_cap:
                break
            await asyncio.sleep(0.05)
        # refused batches move the watermark on too: windows close as far as all data
        last_ts = max(int(b.frame["ts"].max()) for b in batches)
        threshold = await pipeline.wait_closed_through(last_ts - spec.lateness_ms, timeout_s=60)
        await asyncio.sleep(0.5)
        metrics = combiner.metrics()
        await pipeline.stop()
    records = [msgpack.unpackb(d, raw=False) for d in seen.deadletters]
    return seen.results_frame(), records, threshold, metrics


def check_capped(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    run: tuple[pl.DataFrame, list[dict[str, Any]], int, dict[str, object]],
    logged: list[logging.LogRecord],
) -> dict[int, int]:
    """Assert nothing refused is lost and nothing accepted is wrong; the refused seqs' rows."""
    got, records, threshold, metrics = run
    per_batch = batches[0].frame.height
    refused = {}
    for record in records:
        assert record["error"]["reason"] == "state_cap_exceeded"
        assert record["error"]["error"] == "StateCapError"
        assert record["payload_truncated"] is False
        partial = Partial.decode(record["payload"])
        assert partial.rows is not None
        refused[partial.batch.seq] = int(partial.rows.fields["n"].sum())
    assert refused, "the cap never refused anything"
    assert len(refused) < len(batches), "the cap refused everything"
    # Each refused partial carries all of its batch's rows.
    assert refused == dict.fromkeys(refused, per_batch)
    assert metrics["partials_over_cap"] == len(refused) == len(records)
    assert metrics["max_state_cells"] == spec.max_state_cells
    # one error as each episode begins, one warning as it ends
    errors = [r for r in logged if r.levelno >= logging.ERROR]
    ended = [r for r in logged if "applying partials again" in r.getMessage()]
    assert 1 <= len(errors) <= len(refused)
    assert len(ended) <= len(errors) <= len(ended) + 1
    assert f"max_state_cells = {spec.max_state_cells}" in errors[0].getMessage()
    accepted = [b for b in batches if b.seq not in refused]
    expected, late = expected_results(all_rows(accepted), spec)
    assert late == 0
    expected = closed_by(expected, spec, threshold)
    assert expected.height >= (len(accepted) - 2) * per_batch  # all but the last window
    columns = ["window", "start", "key", "rows", "mean", "min", "max"]
    assert_frame_equal(
        got.select(columns).sort("key"),
        expected.select(columns).sort("key"),
        check_dtypes=False,
        rel_tol=1e-9,
    )
    return refused
