"""Two pool combiners hosting the partitions of two deployed pipelines, on a real Mosquitto.

Control plane, two pool workers and two pool combiners (``shoal combiner`` without
``--pipeline``): one in this process (the survivor, whose runtimes the test can read), one a
real child process, killed with SIGKILL while gateways publish. Its ids are chosen so that
it owns partitions of both pipelines. The survivor takes them over (the Will clears the dead
member's announcement; the broker hands it the partitions' sessions; the checkpoint lock is
free; it restores the last checkpoint) within the stated bound; re-sends bring back what
the dead member applied but never confirmed. Every result equals the oracle over its
pipeline's rows. A window the dead member published after its last checkpoint is published
again by the new owner, with the same identity and rows: consumers keep one copy per
(window, start, partition, revision), and a re-publication that differs fails the test
(``dedupe_identical``); each (window, start, key) is then compared with the oracle once.
Late-row reports are kept once per (partition, gateway, seq) likewise. The test's gateways
re-send every second what the partitions' current owners have not applied (``resending``,
as a gateway spool does with unconfirmed batches) and announce seq 0 as their first
unconfirmed one (truthful: a new owner may lack what the old one applied but never
confirmed).

A second case: a member joins (the first lets go of the partitions the joiner wins, with a
last checkpoint, before the joiner takes them: nobody is deposed), then leaves cleanly (the
first takes them back); results stay exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import tomllib
from pathlib import Path

import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.control.assignment import owner
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.runtime.hosting import CombinerHost, HostConfig
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support import processes
from tests.support.compare import assert_matches_oracle, dedupe_identical, scale_of
from tests.support.control import pool_running, running_plane
from tests.support.datasets import GeneratedBatch, all_rows, make_batches
from tests.support.live import Collected, collector, publish_batches, until
from tests.support.live import resending as resend_loop
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

# A gateway whose batches died with the owner holds the watermark until they are re-sent, for
# at most the idle timeout: it must outlast takeover + re-send (gateways re-send on the gap
# hints of the next confirmation), or windows close without them (as after any restart).
COMMON = "lateness_ms = 1000\nidle_timeout_ms = 5000\nlimits = { max_future_ms = false }\n"
TEMPS = (
    'name = "temps"\naggregates = ["count", "sum", "mean", "max"]\npartitions = 2\n'
    + COMMON
    + '[[windows]]\nkind = "tumbling"\nsize_ms = 2000\n'
)
TWIN = 'name = "twin"\naggregates = ["count", "min"]\n' + COMMON + "[[windows]]\nsize_ms = 3000\n"
SLOTS = [("temps", 0), ("temps", 1), ("twin", 0)]
ENCODING = Encoding.BINARY_COLUMNAR
TAKEOVER_BOUND_S = 5.0
"""Will (at once on loopback) + retry/handover checks + CONNECT + lock + restore, with slack."""


def _members() -> tuple[str, str]:
    """(doomed, survivor): the doomed one owns partitions of both pipelines, the survivor one."""
    for i in range(100):
        doomed, survivor = f"c{i}", f"c{i + 1}"
        mine = {s for s in SLOTS if owner([doomed, survivor], *s) == doomed}
        if {n for n, _ in mine} == {"temps", "twin"} and len(mine) < len(SLOTS):
            return doomed, survivor
    raise AssertionError("no pair of ids splits the partitions as wanted")


DOOMED, SURVIVOR = _members()


def applied(batches: list[GeneratedBatch], *hosts: CombinerHost) -> list[int] | None:
    """Indexes of batches some partition has not applied yet (None: some partition has no
    running owner right now, in a handover)."""
    done = {}
    for host in hosts:
        for slot, term in host.terms.items():
            if term.runtime.serving and not term.stopping:
                done[slot] = term.runtime.core.confirmable()
    if set(done) != set(SLOTS):
        return None
    return [
        i
        for i, b in enumerate(batches)
        if any(d.get(b.gateway_id, -1) < b.seq for d in done.values())
    ]


def resending(
    broker: EmbeddedBroker, topics: Topics, sent: list[GeneratedBatch], *hosts: CombinerHost
) -> contextlib.AbstractAsyncContextManager[None]:
    """Re-send, as a gateway's spool does every second, what the partitions' current owners
    have not applied (applied by a member after its last checkpoint, or taken with it)."""
    return resend_loop(
        broker.settings, topics, sent, lambda b: applied(b, *hosts), encoding=ENCODING
    )


def closed_through(host: CombinerHost, name: str) -> int:
    """The pipeline's common close threshold over its partitions."""
    marks = [t.runtime.core.closed_through for (n, _), t in host.terms.items() if n == name]
    return min((m or 0) for m in marks)


def assert_oracle(
    seen: Collected, spec: PipelineSpec, batches: list[GeneratedBatch], threshold: int
) -> None:
    rows = all_rows(batches)
    expected, late_count = expected_results(rows, spec)
    expected = expected.filter(pl.col("end") <= threshold)
    emitted = dedupe_identical(seen.windows).filter(pl.col("end") <= threshold)
    assert expected.height > 0
    assert_matches_oracle(emitted, expected, spec, scale_of(rows, spec))
    # Late rows of a batch the dead member applied after its last checkpoint are reported
    # again when the re-sent batch is applied: one copy per (partition, gateway, seq).
    late: dict[tuple[int, str, int], dict] = {}
    for item in seen.late:
        identity = (item["partition"], item["gateway_id"], item["seq"])
        if identity in late:
            assert late[identity]["late"] == item["late"], f"late rows differ: {identity}"
        late[identity] = item
    assert sum(item["rows"] for item in late.values()) == late_count


async def deploy_both(control: ControlClient, members: list[str]) -> None:
    """Deploy both pipelines as `shoal pipeline deploy` does: stored, served, owned."""
    for text in (TEMPS, TWIN):
        result = await control.request(Request("deploy", f"d{len(text)}", spec_toml=text))
        assert result.ok, result.message
        assert result.name is not None
        assert await control.served(result.name, 1)
        owners = await control.owned(result.name, 1)
        for partition, member in owners.items():
            assert member == owner(members, result.name, partition)


async def finish(host: CombinerHost, batches: list[GeneratedBatch]) -> dict[str, int]:
    """Wait until every batch is applied (with ``resending``) and the windows close; each
    pipeline's close threshold."""
    await until(lambda: applied(batches, host) == [], 30, "every batch applied")
    # Every window the data fills closes once the gateways idle (idle_timeout_ms).
    end = int(all_rows(batches)["ts"].max()) - 1_000
    await until(
        lambda: min(closed_through(host, n) for n in ("temps", "twin")) >= end,
        30,
        "windows closed",
    )
    thresholds = {n: closed_through(host, n) for n in ("temps", "twin")}
    await asyncio.sleep(0.5)  # the last results travel to the collectors
    return thresholds


async def _scenario(broker: EmbeddedBroker, topics: Topics, tmp: Path) -> float:
    settings = broker.settings
    state = tmp / "state"
    batches = make_batches(seed=17, gateways=3, batches_per_gateway=24, rows_per_batch=(0, 60))
    first = [b for b in batches if b.seq < 10]
    rest = [b for b in batches if b.seq >= 10]
    control = ControlClient(settings, topics, timeout_s=15)
    workers = [
        Worker(WorkerConfig(None, settings, topics, worker_id=f"pool{i}", heartbeat_ms=200))
        for i in range(2)
    ]
    survivor = CombinerHost(
        HostConfig(settings, topics, state, combiner_id=SURVIVOR, tick_ms=50, per_key_results=False)
    )
    doomed = processes.pool_combiner(DOOMED, settings, topics, state, tmp)
    async with (
        running_plane(settings, topics, SystemClock()),
        pool_running(*workers, survivor),
        collector(settings, topics, "temps") as temps_seen,
        collector(settings, topics, "twin") as twin_seen,
    ):
        doomed.start()
        try:
            await until(lambda: DOOMED in survivor.members, 30, "the child member's presence")
            await deploy_both(control, [DOOMED, SURVIVOR])
            # Steady traffic; the child applies, checkpoints and confirms its partitions.
            await publish_batches(
                settings,
                topics,
                first,
                list(range(len(first))),
                encoding=ENCODING,
                first_unconfirmed=0,
            )
            await asyncio.sleep(1.5)
            sending = asyncio.create_task(
                publish_batches(
                    settings,
                    topics,
                    rest,
                    list(range(len(rest))),
                    encoding=ENCODING,
                    first_unconfirmed=0,
                    pause_every=6,
                    pause_s=0.1,
                )
            )
            await asyncio.sleep(0.3)
            held = [s for s in SLOTS if owner([DOOMED, SURVIVOR], *s) == DOOMED]
            assert all((state / f"{n}-{k}" / "combiner.ckpt").exists() for n, k in held)
            assert survivor.counters.terms_started == len(SLOTS) - len(held)
            killed_at = time.monotonic()
            doomed.kill9()
            await until(
                lambda: {(o.pipeline, o.partition) for o in survivor.owns()} == set(SLOTS),
                TAKEOVER_BOUND_S,
                "takeover of the dead member's partitions",
            )
            takeover_s = time.monotonic() - killed_at
        except BaseException:
            print(doomed.log_tail())
            raise
        finally:
            doomed.stop()
        async with resending(broker, topics, batches, survivor):
            await sending
            thresholds = await finish(survivor, batches)
        assert survivor.counters.terms_failed == 0
        assert survivor.counters.terms_started == len(SLOTS)  # its own, then the dead one's
        # Heartbeats (and `shoal status`) name the owner of each partition.
        assert {t.runtime.metrics()["owner"] for t in survivor.terms.values()} == {SURVIVOR}
    assert_oracle(temps_seen, _spec(TEMPS), batches, thresholds["temps"])
    assert_oracle(twin_seen, _spec(TWIN), batches, thresholds["twin"])
    return takeover_s


def _spec(text: str) -> PipelineSpec:
    return parse_pipeline(tomllib.loads(text))


@pytest.mark.timeout(120)
def test_a_killed_pool_combiner_is_taken_over_and_results_stay_exact(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    takeover_s = asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 100))
    print(f"takeover of 2 pipelines' partitions after kill -9: {takeover_s:.2f} s")


async def _join_and_leave(broker: EmbeddedBroker, topics: Topics, tmp: Path) -> None:
    settings = broker.settings
    state = tmp / "state"
    batches = make_batches(seed=23, gateways=3, batches_per_gateway=24, rows_per_batch=(0, 60))
    parts = [[b for b in batches if lo <= b.seq < lo + 8] for lo in (0, 8, 16)]
    control = ControlClient(settings, topics, timeout_s=15)
    worker = Worker(WorkerConfig(None, settings, topics, worker_id="pool0", heartbeat_ms=200))

    def host(member: str) -> CombinerHost:
        config = HostConfig(settings, topics, state, member, tick_ms=50, per_key_results=False)
        return CombinerHost(config)

    first, joiner = host(SURVIVOR), host(DOOMED)
    mine = {s for s in SLOTS if owner([DOOMED, SURVIVOR], *s) == SURVIVOR}
    async with (
        running_plane(settings, topics, SystemClock()),
        pool_running(worker, first),
        collector(settings, topics, "temps") as temps_seen,
        collector(settings, topics, "twin") as twin_seen,
    ):
        await deploy_both(control, [SURVIVOR])  # alone, it owns every partition
        sent: list[GeneratedBatch] = []
        async with resending(broker, topics, sent, first, joiner):
            await _handover_and_back(first, joiner, mine, parts, sent, broker, topics)
            thresholds = await finish(first, batches)
        assert first.counters.terms_failed == joiner.counters.terms_failed == 0
    assert_oracle(temps_seen, _spec(TEMPS), batches, thresholds["temps"])
    assert_oracle(twin_seen, _spec(TWIN), batches, thresholds["twin"])


async def _handover_and_back(
    first: CombinerHost,
    joiner: CombinerHost,
    mine: set[tuple[str, int]],
    parts: list[list[GeneratedBatch]],
    sent: list[GeneratedBatch],
    broker: EmbeddedBroker,
    topics: Topics,
) -> None:
    async def send(part: list[GeneratedBatch]) -> None:
        sent.extend(part)
        order = list(range(len(part)))
        await publish_batches(
            broker.settings, topics, part, order, encoding=ENCODING, first_unconfirmed=0
        )

    await send(parts[0])
    # A member joins: the first lets go of what the joiner wins, with a last checkpoint,
    # before the joiner takes it (no session taken from a live owner).
    async with pool_running(joiner):
        await until(
            lambda: {(o.pipeline, o.partition) for o in joiner.owns()} == set(SLOTS) - mine,
            10,
            "handover to the joiner",
        )
        assert {(o.pipeline, o.partition) for o in first.owns()} == mine
        assert first.counters.terms_deposed == 0
        await send(parts[1])
        await asyncio.sleep(1.0)
    # The joiner leaves (SIGTERM): last checkpoints, its announcement cleared; the first
    # member takes its partitions back.
    await until(
        lambda: {(o.pipeline, o.partition) for o in first.owns()} == set(SLOTS),
        10,
        "takeback after a clean leave",
    )
    assert joiner.counters.terms_deposed == 0
    await send(parts[2])


@pytest.mark.timeout(120)
def test_a_joining_member_takes_its_partitions_by_handover_and_a_leaving_one_gives_them_back(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_join_and_leave(broker, topics, tmp_path), 100))
