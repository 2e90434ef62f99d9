"""An update on the pool while gateways publish: each version computes exactly its windows.

Control plane, two pool workers and a pool combiner on a real Mosquitto. Gateways publish at a
steady rate; midway the pipeline is updated (another window size and other aggregates). Each
partition switches at a window boundary (the cut): windows starting before it are finished by
v1, those from it on computed by v2, both versions' state side by side in the partition until
v1's windows closed; then the workers stop computing v1. Every result names its version; for
each version the results equal the oracle over the windows on its side of the cut: nothing
lost, nothing counted twice (no window under both versions, none missing). The test's
gateways re-send every second what a partition has not confirmed (as a spool does): the
batches a worker computed only with v1 before it learnt of the update, which v2 needs.
"""

from __future__ import annotations

import asyncio
import time
import tomllib
from pathlib import Path

import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.processors.partials import KeyRouter
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.runtime.hosting import CombinerHost
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, dedupe_identical, scale_of
from tests.support.control import pool_members, pool_running, running_plane
from tests.support.control import unconfirmed as confirmed_by
from tests.support.datasets import GeneratedBatch, all_rows, make_batches
from tests.support.live import Collected, collector, publish_batches, resending, until
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

COMMON = (
    'name = "temps"\npartitions = 2\nlateness_ms = 1000\nidle_timeout_ms = 3000\n'
    "limits = { max_future_ms = false }\n"
)
V1 = COMMON + 'aggregates = ["count", "sum", "mean", "max"]\n[[windows]]\nsize_ms = 2000\n'
V2 = COMMON + 'aggregates = ["count", "min", "mean"]\n[[windows]]\nsize_ms = 4000\n'
ENCODING = Encoding.BINARY_COLUMNAR


def _spec(text: str) -> PipelineSpec:
    return parse_pipeline(tomllib.loads(text))


def _terms(host: CombinerHost) -> dict[int, object]:
    return {k: t.runtime for (n, k), t in host.terms.items() if n == "temps" and t.runtime.serving}


def unconfirmed(batches: list[GeneratedBatch], host: CombinerHost) -> list[int] | None:
    """Indexes of batches some partition has not confirmed (every open version applied)."""
    return confirmed_by(batches, host, 2)


def by_version(seen: Collected) -> dict[int, pl.DataFrame]:
    """Result rows (each window identity once) per version, with their partition."""
    out = {}
    for version in (1, 2):
        messages = [m for m in seen.windows if m.get("version") == version]
        rows = dedupe_identical(messages) if messages else pl.DataFrame()
        out[version] = rows
    assert all("version" in m for m in seen.windows), "a result without its version"
    return out


async def _scenario(broker: EmbeddedBroker, topics: Topics, tmp: Path) -> dict[str, object]:
    settings = broker.settings
    start = (int(time.time() * 1000) // 1000) * 1000
    batches = make_batches(
        seed=31, gateways=3, batches_per_gateway=30, rows_per_batch=(0, 60), start_ms=start
    )
    early = [b for b in batches if b.seq < 8]
    rest = [b for b in batches if b.seq >= 8]
    rest.sort(key=lambda b: (b.seq, b.gateway_id))
    control = ControlClient(settings, topics, timeout_s=15)
    workers, host = pool_members(settings, topics, tmp / "state")
    sent: list[GeneratedBatch] = []
    async with (
        running_plane(settings, topics, SystemClock()),
        pool_running(*workers, host),
        collector(settings, topics, "temps") as seen,
    ):
        result = await control.request(Request("deploy", "d1", spec_toml=V1))
        assert result.ok, result.message
        await control.served("temps", 1)
        await control.owned("temps", 1)
        sent.extend(early)
        await publish_batches(
            settings, topics, early, list(range(len(early))), encoding=ENCODING, first_unconfirmed=0
        )
        sent.extend(rest)
        resend = resending(
            settings, topics, sent, lambda b: unconfirmed(b, host), encoding=ENCODING
        )
        async with resend:
            sending = asyncio.create_task(
                publish_batches(
                    settings,
                    topics,
                    rest,
                    list(range(len(rest))),
                    encoding=ENCODING,
                    first_unconfirmed=0,
                    pause_every=3,
                    pause_s=0.1,
                )
            )
            await asyncio.sleep(0.8)  # steady traffic, then the update lands in the middle
            assert not sending.done()
            updated = await control.request(Request("update", "u1", spec_toml=V2))
            assert updated.ok, updated.message
            assert updated.version == 2
            await control.owned("temps", 2)
            await sending
            await until(lambda: unconfirmed(batches, host) == [], 40, "every batch confirmed")
        runtimes = _terms(host)
        # v1 ends once its windows closed (gateways idle); workers then stop computing it.
        await until(
            lambda: all(r.chain.versions == (2,) for r in runtimes.values()),  # type: ignore[attr-defined]
            30,
            "v1's windows closed",
        )
        await until(
            lambda: all(not w.routes.pipelines["temps"].older for w in workers),  # type: ignore[attr-defined]
            10,
            "workers dropped v1",
        )
        end = int(all_rows(batches)["ts"].max()) - 1_000
        await until(
            lambda: all((r.core.closed_through or 0) >= end for r in runtimes.values()),  # type: ignore[attr-defined]
            30,
            "v2's windows closed",
        )
        await asyncio.sleep(0.5)  # the last results travel to the collector
        cuts = {k: r.chain.current.from_ms for k, r in runtimes.items()}  # type: ignore[attr-defined]
        closed = {k: r.core.closed_through for k, r in runtimes.items()}  # type: ignore[attr-defined]
        resent = sum(r.core.counters.duplicate_batches for r in runtimes.values())  # type: ignore[attr-defined]
    rows = all_rows(batches)
    emitted = by_version(seen)
    router = KeyRouter(2)
    for version, text in ((1, V1), (2, V2)):
        spec = _spec(text)
        expected, _ = expected_results(rows, spec)
        expected = expected.with_columns(
            partition=pl.col("key").map_elements(router.partition_of, return_dtype=pl.Int64)
        )
        parts = []
        for partition, cut in cuts.items():
            mine = expected.filter(pl.col("partition") == partition)
            side = pl.col("start") < cut if version == 1 else pl.col("start") >= cut
            parts.append(mine.filter(side & (pl.col("end") <= closed[partition])))
        want = pl.concat(parts).drop("partition")
        got = emitted[version]
        assert want.height > 0
        assert got.height > 0
        got = got.filter(pl.col("end") <= max(closed.values()))
        assert_matches_oracle(got, want, spec, scale_of(rows, spec))
    return {"cuts": cuts, "start": start, "duplicates_dropped": resent}


@pytest.mark.timeout(150)
def test_an_update_while_gateways_publish_switches_at_a_window_boundary(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    facts = asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 130))
    print(f"update on the pool: {facts}")
