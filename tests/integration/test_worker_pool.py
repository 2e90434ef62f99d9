"""Two pool workers serving pipelines deployed at run time, on a real Mosquitto.

Control plane, two pool workers (``shoal worker`` without ``--pipeline``) and one combiner
set per pipeline (as ``shoal combiner --pipeline FILE`` runs them), all in this process.
Two pipelines read the same input; each is deployed, and served, before the gateways
publish, so the rows a pipeline owns are exactly the batches published while it is
deployed. Then one is deleted (the workers leave its group; its combiners get nothing
more), and a pool worker is killed while batches are in flight (the other takes the whole
group; gateways' re-sends bring back what died with it). Every result equals the oracle
over the rows its pipeline owned: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.runtime.pool import PoolRoutes
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.control import pool_running, running_plane
from tests.support.datasets import GeneratedBatch, all_rows, make_batches
from tests.support.live import Collected, InProcessPipeline, collector, publish_batches, until
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

COMMON = "lateness_ms = 1000\nidle_timeout_ms = 1500\nlimits = { max_future_ms = false }\n"
TEMPS = (
    'name = "temps"\naggregates = ["count", "sum", "mean", "max"]\npartitions = 2\n'
    + COMMON
    + '[[windows]]\nkind = "tumbling"\nsize_ms = 2000\n'
    '[[windows]]\nkind = "hopping"\nsize_ms = 4000\nslide_ms = 2000\n'
)
TWIN = (  # the same input filter (the default, ingest/+/+), another computation
    'name = "twin"\naggregates = ["count", "min"]\n'
    + COMMON
    + '[[windows]]\nkind = "tumbling"\nsize_ms = 3000\n'
)
ENCODING = Encoding.BINARY_COLUMNAR


def as_file(text: str) -> PipelineSpec:
    """The spec as ``shoal combiner --pipeline FILE`` reads it."""
    return parse_pipeline(tomllib.loads(text))


def serving(workers: list[Worker]) -> list[dict[str, int]]:
    out = []
    for worker in workers:
        assert isinstance(worker.routes, PoolRoutes)
        out.append({n: p.version for n, p in worker.routes.pipelines.items()})
    return out


def assert_oracle(
    pipeline: InProcessPipeline, seen: Collected, batches: list[GeneratedBatch], threshold: int
) -> None:
    rows = all_rows(batches)
    expected, late_count = expected_results(rows, pipeline.spec)
    expected = expected.filter(pl.col("end") <= threshold)
    assert expected.height > 0
    assert_matches_oracle(
        seen.results_frame(), expected, pipeline.spec, scale_of(rows, pipeline.spec)
    )
    assert sum(item["rows"] for item in seen.late) == late_count


async def _scenario(broker: EmbeddedBroker, topics: Topics, state: Path) -> None:
    settings = broker.settings
    batches = make_batches(seed=15, gateways=3, batches_per_gateway=24, rows_per_batch=(0, 60))
    first = [b for b in batches if b.seq < 8]
    second = [b for b in batches if 8 <= b.seq < 16]
    third = [b for b in batches if b.seq >= 16]
    control = ControlClient(settings, topics, timeout_s=10)
    workers = [
        Worker(
            WorkerConfig(
                None, settings, topics, worker_id=f"{topics.root}-pool{i}", heartbeat_ms=200
            )
        )
        for i in range(2)
    ]
    temps = InProcessPipeline(as_file(TEMPS), settings, topics, workers=0, state_dir=state / "t")
    twin = InProcessPipeline(as_file(TWIN), settings, topics, workers=0, state_dir=state / "w")
    async with (
        running_plane(settings, topics, SystemClock()),
        pool_running(*workers) as tasks,
        collector(settings, topics, "temps") as temps_seen,
        collector(settings, topics, "twin") as twin_seen,
    ):
        await temps.start()
        await twin.start()
        for text in (TEMPS, TWIN):
            result = await control.request(Request("deploy", f"d-{len(text)}", spec_toml=text))
            assert result.ok, result.message
            assert result.name is not None
            assert result.version == 1
            assert await control.served(result.name, 1)  # what `shoal pipeline deploy` waits for
        await until(lambda: serving(workers) == [{"temps": 1, "twin": 1}] * 2)

        # 1. Both pipelines get every batch: one delivery per group, routed by identifier.
        await publish_batches(settings, topics, first, list(range(len(first))), encoding=ENCODING)
        last = {b.gateway_id: 7 for b in first}
        await temps.wait_applied(last)
        await twin.wait_applied(last)
        assert all(w.counters.batches > 0 for w in workers), "each worker took its turn"
        # Each batch once per group: two deliveries, each to its own pipeline's handler.
        assert sum(w.counters.batches for w in workers) == 2 * len(first)
        max_ts = max(int(b.frame["ts"].max()) for b in first if b.frame.height)
        twin_threshold = await twin.wait_closed_through(max_ts - 1_000)  # the gateways idle

        # 2. Delete twin: both workers leave its group; its combiner gets nothing more.
        result = await control.request(Request("delete", "del", name="twin"))
        assert result.ok, result.message
        await until(lambda: serving(workers) == [{"temps": 1}] * 2)
        applied_twin = twin.applied_through()
        await publish_batches(settings, topics, second, list(range(len(second))), encoding=ENCODING)
        await temps.wait_applied({b.gateway_id: 15 for b in second})
        await asyncio.sleep(0.5)
        assert twin.applied_through() == applied_twin
        await twin.stop()

        # 3. Kill a pool worker (its task cancelled, nothing acknowledged) while batches are
        # in flight: the other serves the whole group; re-sends bring back what it held.
        sending = asyncio.create_task(
            publish_batches(
                settings,
                topics,
                third,
                list(range(len(third))),
                encoding=ENCODING,
                pause_every=6,
                pause_s=0.1,
            )
        )
        await asyncio.sleep(0.15)
        tasks[0].cancel()
        workers[0].stop()  # should the cancel land in a reconnect, it does not reconnect
        await asyncio.gather(tasks[0], return_exceptions=True)
        survivor_at_kill = workers[1].counters.batches
        await sending
        await temps.resend_until_applied(settings, topics, third, encoding=ENCODING, wait_s=2.0)
        threshold = await temps.finish(batches)
        assert workers[1].counters.unrouted == 0
        assert workers[1].counters.batches > survivor_at_kill  # it took the whole group

    assert_oracle(temps, temps_seen, batches, threshold)
    assert_oracle(twin, twin_seen, first, twin_threshold)


def test_two_pool_workers_serve_deploy_share_delete_and_survive_a_kill(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 120))
