"""The real worker and combiner components, end to end on the in-memory broker (no Mosquitto).

The same runtime code as in production (shared subscription, manual acks, persistent combiner
sessions, retained gateway status, checkpoints); only the broker is ``shoal.broker.memory``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import msgpack
import numpy as np
import orjson
import polars as pl

from shoal.broker.memory import MemoryBroker
from shoal.runtime import combiner as combiner_module
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import all_rows, make_batches, make_spec, two_window_spec
from tests.support.in_memory import shuffled_with_duplicates
from tests.support.live import InProcessPipeline, collector, publish_batches, run_against_oracle
from tests.support.oracle import closed_by, expected_results

SPEC = two_window_spec(
    "mem",
    ["count", "sum", "mean", "min", "max", "stddev", "p95"],
    2,
    checkpoint_interval_ms=200,
)


def test_three_workers_and_two_partitions_give_the_oracle_results(tmp_path) -> None:
    memory = MemoryBroker()
    batches = make_batches(
        seed=11, gateways=3, batches_per_gateway=12, rows_per_batch=(0, 80), gap_every=5
    )
    rng = np.random.default_rng(3)
    order = shuffled_with_duplicates(len(batches), rng, 0.25)

    async def scenario() -> None:
        run = await run_against_oracle(
            SPEC,
            batches,
            order,
            settings=memory.settings,
            topics=Topics(root="mem"),
            workers=3,
            state_dir=tmp_path,
            encoding=Encoding.BINARY_COLUMNAR,
            session_factory=memory.session_factory,
        )
        assert run.late_count > 0
        assert all(c.core.counters.duplicate_batches > 0 for c in run.pipeline.combiners)
        handled = [w.counters.batches for w in run.pipeline.workers]
        assert sum(handled) == len(order)
        assert all(n > 0 for n in handled), "the shared subscription dealt to every worker"
        confirmed = {gw: seq for (gw, _), seq in run.seen.confirms.items()}
        assert confirmed == {b.gateway_id: 11 for b in batches}

    asyncio.run(scenario())


def test_a_draining_worker_leaves_without_losing_a_batch() -> None:
    memory = MemoryBroker()
    topics = Topics(root="drain")
    spec = SPEC
    batches = make_batches(seed=5, gateways=2, batches_per_gateway=20, rows_per_batch=(1, 40))

    async def scenario() -> None:
        pipeline = InProcessPipeline(
            spec,
            memory.settings,
            topics,
            workers=2,
            state_dir=None,
            session_factory=memory.session_factory,
        )
        await pipeline.start()
        leaving = pipeline.workers[0]
        async with memory.session(memory.settings, "operator") as operator:
            await publish_batches(
                memory.settings,
                topics,
                batches,
                list(range(len(batches))),
                encoding=Encoding.JSON_ROWS,
                session_factory=memory.session_factory,
            )
            await operator.publish(
                topics.control(leaving.worker_id), orjson.dumps({"cmd": "drain"})
            )
        worker_task = pipeline.tasks[len(pipeline.combiners)]  # leaving.run()
        await asyncio.wait_for(asyncio.shield(worker_task), 10)
        await pipeline.wait_applied({b.gateway_id: 19 for b in batches}, timeout_s=10)
        assert leaving.worker_id not in memory.connected()
        await pipeline.stop()
        assert sum(w.counters.batches for w in pipeline.workers) == len(batches)

    asyncio.run(scenario())


def test_session_windows_give_the_oracle_results(tmp_path) -> None:
    """The runtime's session path (split per start, each key's own end, checkpoints)."""
    memory = MemoryBroker()
    spec = make_spec(
        "memsessions",
        [{"kind": "session", "gap_ms": 1_200, "max_duration_ms": 8_000}],
        ["count", "sum", "mean", "max", "p95"],
        2,
        checkpoint_interval_ms=200,
    )
    batches = make_batches(
        seed=21, gateways=3, batches_per_gateway=12, rows_per_batch=(0, 60), gap_every=4
    )
    order = shuffled_with_duplicates(len(batches), np.random.default_rng(8), 0.25)

    async def scenario() -> None:
        run = await run_against_oracle(
            spec,
            batches,
            order,
            settings=memory.settings,
            topics=Topics(root="memsessions"),
            workers=3,
            state_dir=tmp_path,
            encoding=Encoding.BINARY_COLUMNAR,
            session_factory=memory.session_factory,
        )
        assert run.late_count > 0
        assert sum(c.core.counters.windows_closed for c in run.pipeline.combiners) > 5

    asyncio.run(scenario())


def test_a_result_row_no_packet_can_carry_is_dead_lettered_and_the_rest_flows(
    tmp_path, monkeypatch
) -> None:
    """A tiny budget for a window message's rows (as a tiny max_packet_size would give):
    windows split into many parts; the one key whose row alone exceeds it is dead-lettered
    and counted, never retried, and every other key arrives exactly once."""

    monkeypatch.setattr(combiner_module, "body_budget", lambda _limit: 300)
    long_key = "L" * 250
    memory = MemoryBroker()
    spec = two_window_spec("huge", ["count", "mean"], 1, checkpoint_interval_ms=100)
    batches = [
        replace(
            b,
            frame=b.frame.with_columns(pl.col("sensor_id").replace({"shared-k0": long_key})),
        )
        for b in make_batches(seed=4, gateways=2, batches_per_gateway=10, rows_per_batch=(5, 30))
    ]
    topics = Topics(root="huge")

    async def scenario() -> None:
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
            threshold = await pipeline.finish(batches)
        expected, _ = expected_results(all_rows(batches), spec)
        expected = closed_by(expected, spec, threshold)
        got = seen.results_frame()
        assert got.select("window", "start", "key").is_duplicated().sum() == 0
        want = expected.filter(pl.col("key") != long_key).select("window", "start", "key")
        assert sorted(got.select("window", "start", "key").rows()) == sorted(want.rows())
        assert max(w.get("parts", 1) for w in seen.windows) > 2
        refused = expected.filter(pl.col("key") == long_key).height
        assert refused > 0
        records = [msgpack.unpackb(d, raw=False) for d in seen.deadletters]
        assert [r["error"]["reason"] for r in records] == ["result_too_large"] * refused
        assert all(long_key in r["payload"].decode() for r in records)
        assert pipeline.combiners[0].results_refused == refused
        confirmed = {gw: seq for (gw, _), seq in seen.confirms.items()}
        assert confirmed == {"gw0": 9, "gw1": 9}

    asyncio.run(scenario())
