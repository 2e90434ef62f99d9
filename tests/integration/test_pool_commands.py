"""``shoal pipeline flush NAME`` and ``shoal pipeline drain`` on the pools, on a real Mosquitto.

A pipeline whose gateways stay "active" (long idle timeout) keeps its windows open; ``flush``
makes its combiner partitions emit them at once, equal to the oracle over every row, and
returns once each partition confirmed (``not_flushed`` when no combiner answers). ``drain``
makes every pool worker leave without losing a batch and exit; then no pool worker is left.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tomllib
from pathlib import Path

import orjson
import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, dedupe_identical, scale_of
from tests.support.control import pool_members, pool_running, running_plane, unconfirmed
from tests.support.datasets import all_rows, make_batches
from tests.support.live import collector, publish_batches, until
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

SPEC = (
    'name = "held"\naggregates = ["count", "sum"]\npartitions = 2\nlateness_ms = 1000\n'
    "idle_timeout_ms = 600000\nlimits = { max_future_ms = false }\n[[windows]]\nsize_ms = 2000\n"
)


def _cli(
    broker: EmbeddedBroker, topics: Topics, *args: str, stdin: str = "", timeout: str = "10"
) -> tuple[int, dict]:
    argv = [sys.executable, "-m", "shoal.cli", "pipeline", *args, "--json"]
    argv += ["--broker", broker.settings.url, "--topic-root", topics.root, "--timeout", timeout]
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode, orjson.loads(done.stdout)


async def _scenario(broker: EmbeddedBroker, topics: Topics, tmp: Path) -> None:
    settings = broker.settings
    batches = make_batches(seed=5, gateways=2, batches_per_gateway=6, late_fraction=0.0)
    workers, host = pool_members(settings, topics, tmp / "state")
    async with (
        running_plane(settings, topics, SystemClock()),
        pool_running(*workers, host) as tasks,
        collector(settings, topics, "held") as seen,
    ):
        code, _ = await asyncio.to_thread(_cli, broker, topics, "deploy", "-", stdin=SPEC)
        assert code == 0
        await publish_batches(
            settings, topics, batches, list(range(len(batches))), encoding=Encoding.JSON_ROWS
        )
        await until(lambda: unconfirmed(batches, host, 2) == [], 20, "every batch applied")
        closed_before = len(seen.windows)
        code, answer = await asyncio.to_thread(_cli, broker, topics, "flush", "nope")
        assert (code, answer["reason"]) == (1, "unknown_pipeline")
        code, answer = await asyncio.to_thread(_cli, broker, topics, "flush", "held")
        assert (code, answer["computation"]) == (0, "held"), answer
        # Each partition confirmed, once the broker had what its flush published.
        assert answer["partitions"] == 2
        assert sorted(answer["confirmed"]) == ["0", "1"]
        assert {c["owner"] for c in answer["confirmed"].values()} == {"c0"}
        assert answer["windows"] == sum(c["windows"] for c in answer["confirmed"].values()) > 0
        last_end = int(all_rows(batches)["ts"].max()) // 2000 * 2000 + 2000
        await until(
            lambda: any(m["end"] == last_end for m in seen.windows), 2, "the last window flushed"
        )
        assert len(seen.windows) > closed_before
        await asyncio.sleep(0.3)
        code, answer = await asyncio.to_thread(_cli, broker, topics, "drain")
        assert code == 0, answer
        assert sorted(answer["workers"]) == ["pool0", "pool1"]
        await until(lambda: all(t.done() for t in tasks[:2]), 10, "pool workers exited")
        code, answer = await asyncio.to_thread(_cli, broker, topics, "drain")
        assert (code, answer["reason"]) == (2, "no_workers")
        # No combiner left: nobody confirms a flush, and the command says so.
        host.stop()
        await until(tasks[2].done, 20, "the pool combiner stopped")
        code, answer = await asyncio.to_thread(_cli, broker, topics, "flush", "held", timeout="2")
        assert (code, answer["reason"], answer["confirmed"]) == (2, "not_flushed", {}), answer
    spec = parse_pipeline(tomllib.loads(SPEC))
    rows = all_rows(batches)
    expected, _ = expected_results(rows, spec)
    got = dedupe_identical(seen.windows)
    assert_matches_oracle(
        got, expected.filter(pl.col("end") <= last_end), spec, scale_of(rows, spec)
    )


@pytest.mark.timeout(120)
def test_flush_emits_open_windows_and_drain_empties_the_worker_pool(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 100))
