"""The combiner's state cap: a partial that could grow open state beyond ``max_state_cells``
is refused whole, dead-lettered with its rows and counted; what was accepted is exact."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from shoal.broker.memory import MemoryBroker
from shoal.clock import FakeClock
from shoal.errors import ConfigError, StateCapError
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import DEFAULT_MAX_STATE_CELLS, parse_pipeline
from shoal.schemas import FRAME_SCHEMA, Encoding
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support.datasets import GeneratedBatch, all_rows, make_spec
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.oracle import closed_by, expected_results

T0 = 1_700_000_000_000


def keyed_frame(keys: list[str], ts: np.ndarray, values: np.ndarray) -> pl.DataFrame:
    return pl.DataFrame(
        {"sensor_id": keys, "ts": ts, "value": values, "name": None, "type": None, "unit": None},
        schema=FRAME_SCHEMA,
    )


def test_the_cap_is_read_from_limits_with_a_default_and_checked() -> None:
    base = {"name": "c", "windows": [{"kind": "tumbling", "size_ms": 1_000}]}
    assert parse_pipeline(base).max_state_cells == DEFAULT_MAX_STATE_CELLS
    assert parse_pipeline({**base, "limits": {"max_state_cells": 5_000}}).max_state_cells == 5_000
    for bad in (0, 999, -1, "many", 2.5):
        with pytest.raises(ConfigError, match="max_state_cells") as caught:
            parse_pipeline({**base, "limits": {"max_state_cells": bad}})
        assert caught.value.field == "limits.max_state_cells"


def test_a_partial_over_the_cap_is_refused_whole_and_its_seq_moves_on() -> None:
    spec = parse_pipeline(
        {
            "name": "c",
            "windows": [{"kind": "tumbling", "size_ms": 1_000}],
            "aggregates": ["count", "sum"],
            "lateness_ms": 0,
            "idle_timeout_ms": 1_000,
            "limits": {"max_state_cells": 1_000},
        }
    )
    clock = FakeClock()
    builder = PartialBuilder(spec, "w1")
    core = Combiner(spec, 0, clock)
    core.receive_status(GatewayStatus("g", "s", 10, 0, 10, 0, None, 0, 0, 0))

    def send(seq: int, keys: int, ts: int) -> tuple[int, list[tuple[Partial, StateCapError]]]:
        names = [f"k{seq}-{i}" for i in range(keys)]
        frame = keyed_frame(names, np.full(keys, ts, np.int64), np.ones(keys))
        batch = BatchInfo("g", seq, "s", 0, None, None, 0, 0, "w1")
        step = core.receive(builder.build(frame, batch, clock.now_ms())[0])
        return step.applied, step.over_cap

    assert send(0, 600, 100) == (1, [])
    applied, refused = send(1, 600, 200)  # 600 + 600 > 1,000: refused whole
    assert applied == 0
    [(partial, error)] = refused
    assert (partial.batch.gateway_id, partial.batch.seq) == ("g", 1)
    assert partial.rows is not None
    assert len(partial.rows) == 600
    assert (error.reason, error.cells, error.incoming, error.cap) == (
        "state_cap_exceeded",
        600,
        600,
        1_000,
    )
    assert error.as_record()["code"] == "state_cap_exceeded"
    assert core.counters.partials_over_cap == 1
    assert core.state_cells == 600  # nothing of it applied
    assert core.tracker.gateways["g"].applied_through == 1  # handled: the seq moves on
    assert core.confirmable() == {"g": 1}
    assert core.tracker.watermark("g") == 200  # its event times count as progress
    # A small batch still fits and moves the watermark on; the window it passes closes,
    # its state frees, and a batch as large as the refused one is taken again.
    assert send(2, 10, 1_500) == (1, [])
    closed = core.tick().closed
    assert closed is not None
    assert closed.frame["rows"].sum() == 600
    assert core.state_cells == 10
    assert send(3, 600, 1_600) == (1, [])
    assert core.counters.partials_over_cap == 1


def test_a_million_keys_past_a_low_cap(tmp_path, caplog) -> None:
    """1M distinct keys in 10 batches through worker and combiner, cap 250,000 cells: the
    batches that would pass it are dead-lettered whole (every row in the record), counted in
    the heartbeat and logged once, as one error; every accepted row is in the results,
    exactly as polars computes them from the accepted batches alone."""
    caplog.set_level(logging.INFO, logger="shoal.runtime.combiner")
    memory = MemoryBroker()
    spec = make_spec(
        "capped",
        [{"kind": "tumbling", "size_ms": 2_000}],
        ["count", "mean", "min", "max"],
        limits={"max_state_cells": 250_000, "max_future_ms": False},
        checkpoint_interval_ms=200,
    )
    per_batch = 100_000
    rng = np.random.default_rng(20)
    batches = [
        GeneratedBatch(
            "g1",
            seq,
            keyed_frame(
                [f"s{seq}-{i}" for i in range(per_batch)],
                T0 + seq * 1_000 + rng.integers(0, 1_000, per_batch),
                rng.normal(20.0, 5.0, per_batch),
            ),
        )
        for seq in range(10)
    ]
    topics = Topics(root="capped")

    async def scenario() -> tuple[pl.DataFrame, list[dict[str, object]], int, dict[str, object]]:
        pipeline = InProcessPipeline(
            spec,
            memory.settings,
            topics,
            workers=1,
            state_dir=tmp_path,
            session_factory=memory.session_factory,
        )
        async with collector(
            memory.settings, topics, spec.name, session_factory=memory.session_factory
        ) as seen:
            await pipeline.start()
            await publish_batches(
                memory.settings,
                topics,
                batches,
                list(range(len(batches))),
                encoding=Encoding.BINARY_COLUMNAR,
                session_factory=memory.session_factory,
            )
            await pipeline.wait_applied({"g1": 9}, timeout_s=120)
            combiner = pipeline.combiners[0]
            for _ in range(200):
                if len(seen.deadletters) >= combiner.core.counters.partials_over_cap:
                    break
                await asyncio.sleep(0.05)
            records = [msgpack.unpackb(d, raw=False) for d in seen.deadletters]
            # refused batches move the watermark on too: windows close as far as all data
            last_ts = max(int(b.frame["ts"].max()) for b in batches)
            threshold = await pipeline.wait_closed_through(last_ts - spec.lateness_ms, timeout_s=60)
            await asyncio.sleep(0.5)
            metrics = combiner.metrics()
            await pipeline.stop()
        return seen.results_frame(), records, threshold, metrics

    got, records, threshold, metrics = asyncio.run(scenario())
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
    assert metrics["max_state_cells"] == 250_000
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 1 <= len(errors) <= len(refused)
    assert "max_state_cells = 250000" in errors[0].getMessage()
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
