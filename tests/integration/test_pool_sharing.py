"""Two identical specs under two names share one computation, on a real Mosquitto.

Control plane, two pool workers and a pool combiner. ``temps`` is deployed, then ``twin``
with the same spec (name aside): ``twin`` becomes an alias of ``temps`` (``shoal pipeline
list --json``: one computation, two names, refs 2), the workers keep one shared subscription
group (the broker's own count of shared subscriptions does not change:
``$SYS/broker/shared_subscriptions/count``), and every window message is published on both
names' result topics. ``temps`` is then deleted while gateways go on publishing: its
computation goes on for ``twin`` (released), whose results stay exact over every row;
``temps`` gets no more. Deleting ``twin`` ends it.
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

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message
from shoal.clock import SystemClock
from shoal.processors.spec import parse_pipeline
from shoal.runtime.hosting import CombinerHost
from shoal.runtime.pool import PoolRoutes
from shoal.runtime.worker import Worker
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle, dedupe_identical, scale_of
from tests.support.control import pool_members, pool_running, running_plane
from tests.support.control import unconfirmed as confirmed_by
from tests.support.datasets import GeneratedBatch, all_rows, make_batches
from tests.support.live import collector, publish_batches, resending, until
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

BODY = (
    'aggregates = ["count", "sum", "max"]\npartitions = 2\nlateness_ms = 1000\n'
    "idle_timeout_ms = 2000\nlimits = { max_future_ms = false }\n"
    "[[windows]]\nsize_ms = 2000\n"
)
TEMPS = 'name = "temps"\n' + BODY
TWIN = 'name = "twin"\n' + BODY
ENCODING = Encoding.BINARY_COLUMNAR


def _cli(broker: EmbeddedBroker, topics: Topics, *args: str, stdin: str = "") -> dict:
    argv = [sys.executable, "-m", "shoal.cli", "pipeline", *args, "--json"]
    argv += ["--broker", broker.settings.url, "--topic-root", topics.root, "--timeout", "10"]
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout)


def groups(workers: list[Worker]) -> list[list[str]]:
    """Per pool worker, the pipelines it computes (one shared subscription group each)."""
    out = []
    for worker in workers:
        assert isinstance(worker.routes, PoolRoutes)
        out.append(sorted(worker.routes.pipelines))
    return out


async def shared_subscriptions(broker: EmbeddedBroker, expect: int | None = None) -> int:
    """The broker's count of shared subscriptions (``$SYS/broker/shared_subscriptions/count``,
    refreshed every ``sys_interval``, 1 s in the dev profile), once two readings 1.2 s apart
    agree; with ``expect``, read on (up to 15 s) until it shows that value.

    Members join a group when they see the deployed document, which on a loaded machine can
    come after the combiners took their partitions: one reading could come first.
    """
    last = None
    deadline = asyncio.get_running_loop().time() + 15
    for attempt in range(30):
        async with AsyncSession(broker.settings, f"sys-probe-{attempt}") as probe:
            await probe.subscribe(["$SYS/broker/shared_subscriptions/count"])
            got: Message = await asyncio.wait_for(anext(aiter(probe.messages())), 5)
        value = int(got.payload)
        settled = value == last and (expect is None or value == expect)
        if settled or (expect is not None and asyncio.get_running_loop().time() > deadline):
            return value
        last = value
        await asyncio.sleep(1.2)
    raise AssertionError(f"the shared subscription count did not settle (last {last})")


def unconfirmed(batches: list[GeneratedBatch], host: CombinerHost) -> list[int] | None:
    return confirmed_by(batches, host, 2)


async def _scenario(broker: EmbeddedBroker, topics: Topics, tmp: Path) -> dict[str, object]:
    settings = broker.settings
    batches = make_batches(seed=41, gateways=3, batches_per_gateway=24, rows_per_batch=(0, 50))
    first = [b for b in batches if b.seq < 12]
    second = [b for b in batches if b.seq >= 12]
    workers, host = pool_members(settings, topics, tmp / "state")
    sent: list[GeneratedBatch] = []
    async with (
        running_plane(settings, topics, SystemClock()),
        pool_running(*workers, host),
        collector(settings, topics, "temps") as temps_seen,
        collector(settings, topics, "twin") as twin_seen,
    ):
        # Mosquitto's own count; Mochi publishes no such counter (docs/brokers.md)
        counted = broker.broker == "mosquitto"
        before = await shared_subscriptions(broker) if counted else None
        deployed = await asyncio.to_thread(_cli, broker, topics, "deploy", "-", stdin=TEMPS)
        assert "alias_of" not in deployed
        await until(lambda: len(host.owns()) == 2, 20, "both partitions subscribed")
        computing = (
            await shared_subscriptions(broker, expect=before + 2) if before is not None else None
        )
        shared = await asyncio.to_thread(_cli, broker, topics, "deploy", "-", stdin=TWIN)
        assert shared["alias_of"] == "temps"
        # the broker's own count: both workers joined the computation's shared group (one
        # shared subscription each); the second name joined none
        if before is not None and computing is not None:
            assert computing - before == 2
            assert await shared_subscriptions(broker) == computing
        assert shared["confirmed"]["workers"]  # the computation it shares is served
        listed = await asyncio.to_thread(_cli, broker, topics, "list")
        by_name = {p["name"]: p for p in listed["pipelines"]}
        assert by_name["temps"]["refs"] == by_name["twin"]["refs"] == 2
        assert by_name["twin"]["computation"] == "temps"
        assert by_name["temps"]["names"] == ["temps", "twin"]
        assert groups(workers) == [["temps"], ["temps"]]  # one subscription group, not two
        resend = resending(
            settings, topics, sent, lambda b: unconfirmed(b, host), encoding=ENCODING
        )
        async with resend:
            sent.extend(first)
            await publish_batches(
                settings, topics, first, list(range(len(first))), encoding=ENCODING
            )
            await until(lambda: unconfirmed(first, host) == [], 30, "first half applied")
            await until(lambda: len(temps_seen.windows) > 0, 20, "results under temps")
            # Delete the first name: the computation goes on for twin.
            deleted = await asyncio.to_thread(_cli, broker, topics, "delete", "temps")
            assert deleted["ok"]
            listed = await asyncio.to_thread(_cli, broker, topics, "list")
            by_name = {p["name"]: p for p in listed["pipelines"]}
            assert by_name["temps"]["released"]
            assert by_name["twin"]["refs"] == 1
            await asyncio.sleep(0.5)  # the hosts learn it before the next windows close
            temps_windows = len(temps_seen.windows)
            sent.extend(second)
            await publish_batches(
                settings, topics, second, list(range(len(second))), encoding=ENCODING
            )
            await until(lambda: unconfirmed(batches, host) == [], 30, "every batch applied")
        assert groups(workers) == [["temps"], ["temps"]]
        end = int(all_rows(batches)["ts"].max()) - 1_000
        runtimes = [t.runtime for t in host.terms.values()]
        await until(
            lambda: all((r.core.closed_through or 0) >= end for r in runtimes), 30, "closed"
        )
        threshold = min(r.core.closed_through or 0 for r in runtimes)
        await asyncio.sleep(0.5)
        after_delete = len(temps_seen.windows) - temps_windows
        assert after_delete == 0  # no result under a deleted name
        # The last name gone, the computation ends: workers leave the group.
        await asyncio.to_thread(_cli, broker, topics, "delete", "twin")
        await until(lambda: groups(workers) == [[], []], 10, "workers left the group")
    spec = parse_pipeline(tomllib.loads(TEMPS))
    rows = all_rows(batches)
    expected, _ = expected_results(rows, spec)
    twin_rows = dedupe_identical(twin_seen.windows).filter(pl.col("end") <= threshold)
    assert_matches_oracle(
        twin_rows, expected.filter(pl.col("end") <= threshold), spec, scale_of(rows, spec)
    )
    temps_rows = dedupe_identical(temps_seen.windows)
    got = expected.join(temps_rows.select("window", "start").unique(), on=["window", "start"])
    assert_matches_oracle(temps_rows, got, spec, scale_of(rows, spec))
    assert temps_rows.height < twin_rows.height  # temps stopped getting results at its delete
    return {
        "shared_subscriptions": (before, computing),
        "twin_windows": len(twin_seen.windows),
        "temps_windows": len(temps_seen.windows),
        "temps_after_delete": after_delete,
    }


@pytest.mark.timeout(150)
def test_identical_specs_share_one_computation_and_deleting_one_name_keeps_the_other(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    facts = asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 130))
    print(f"sharing: {facts}")
