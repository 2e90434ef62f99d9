"""A pool combiner killed -9 while corrections flow: its successor re-takes its logged closes.

Real Mosquitto, control plane, two pool workers, two pool combiners: the survivor in this
process, the doomed one a child process. The survivor owns the partition first and hands it
to the doomed member when it joins (a last checkpoint). Then the timing-dependent case of
corrections (docs/guarantees.md, "Late corrections"): gateway a runs ahead, b and c stop
behind it; once every gateway is idle the windows up to a's data close without b's and c's
next rows, which arrive next and are published as corrections (revision 2, 3, ...);
a's rows far behind its own data are late. The doomed member is killed -9 before any
further checkpoint, the survivor takes the partition over, restores the handover checkpoint
and the close log, and the gateways re-send what was never confirmed in another order: b's
and c's batches first, a's last. Without the log the survivor would close those windows only
once b's and c's rows are in, and publish revision 1 with other rows than before the crash
(``dedupe_identical`` fails); with it, every close is re-taken at the same point, so every
(window, start, revision) has one content and the latest revisions equal the polars oracle.
"""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.control.assignment import owner
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.processors.combine import CombinerCounters
from shoal.processors.spec import parse_pipeline
from shoal.runtime.hosting import CombinerHost, HostConfig
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support import processes
from tests.support.compare import assert_matches_oracle, dedupe_identical, scale_of
from tests.support.control import pool_running, running_plane
from tests.support.datasets import GeneratedBatch, all_rows, frame_of
from tests.support.live import Collected, collector, publish_batches, until
from tests.support.live import resending as resend_loop
from tests.support.oracle import expected_results

pytestmark = pytest.mark.broker

NAME = "fixes"
TEXT = f"""
name = "{NAME}"
aggregates = ["count", "sum", "min", "max"]
lateness_ms = 1000
allowed_lateness_ms = 20000
idle_timeout_ms = 2000
checkpoint_interval_ms = 60000
limits = {{ max_future_ms = false }}
[[windows]]
kind = "tumbling"
size_ms = 2000
"""
SPEC = parse_pipeline(tomllib.loads(TEXT))
SLOT = (NAME, 0)
ENCODING = Encoding.BINARY_COLUMNAR
T = 1_700_000_000_000
THROUGH = T + 34_000
"""Every window ending by then closes once the gateways idle after the last batches."""


def _members() -> tuple[str, str]:
    """(doomed, survivor): ids that give the partition to the doomed member once it joins."""
    for i in range(100):
        doomed, survivor = f"m{i}", f"m{i + 1}"
        if owner([doomed, survivor], *SLOT) == doomed:
            return doomed, survivor
    raise AssertionError("no pair of ids gives the partition to the joining member")


DOOMED, SURVIVOR = _members()


def _batch(
    rng: np.random.Generator, gateway: str, seq: int, span: tuple[int, int], extra: list[int]
) -> GeneratedBatch:
    """Rows of five keys spread over ``span`` (ms after T), plus rows at ``extra``."""
    times = np.sort(rng.integers(span[0], span[1], 30)).tolist() + extra
    rows = [(f"k{rng.integers(0, 5)}", T + t, round(float(rng.normal(20, 8)), 3)) for t in times]
    return GeneratedBatch(gateway, seq, frame_of(rows))


def _data() -> dict[str, list[GeneratedBatch]]:
    """The phases (times in ms after T; windows of 2 s; lateness 1 s, allowed 20 s).

    Corrections only reach windows the allowance still keeps after a closes everything up
    to its data (threshold 33 s: kept from 13 s on), and a's late rows are late by its own
    rule (window end 2 s + 21 s <= 32 s), so the oracle's rule decides every row.
    """
    rng = np.random.default_rng(5)
    return {
        "handed": [
            _batch(rng, g, s, (s * 2_000, s * 2_000 + 2_000), []) for g in "abc" for s in (0, 1)
        ],
        "ahead": [
            _batch(rng, "a", 2, (4_000, 12_000), []),
            _batch(rng, "a", 3, (12_000, 22_000), []),
            _batch(rng, "a", 4, (22_000, 32_000), []),
            _batch(rng, "a", 5, (32_000, 34_000), [500, 700, 15_000]),  # late; a correction
            _batch(rng, "b", 2, (4_000, 12_000), []),
            _batch(rng, "c", 2, (4_000, 12_000), []),
        ],
        "behind": [  # on time for b and c, after their windows closed: corrections
            _batch(rng, "b", 3, (12_000, 24_000), []),
            _batch(rng, "c", 3, (12_000, 24_000), []),
        ],
        "after": [
            _batch(rng, "b", 4, (24_000, 30_000), []),
            _batch(rng, "a", 6, (34_000, 36_000), []),
        ],
    }


def unapplied(batches: list[GeneratedBatch], host: CombinerHost) -> list[int] | None:
    """Indexes of batches the serving owner (this host) has not applied; None: not serving."""
    term = host.terms.get(SLOT)
    if term is None or not term.runtime.serving or term.stopping:
        return None
    done = term.runtime.chain.confirmable()
    return [i for i, b in enumerate(batches) if done.get(b.gateway_id, -1) < b.seq]


async def send(broker: EmbeddedBroker, topics: Topics, batches: list[GeneratedBatch]) -> None:
    order = list(range(len(batches)))
    await publish_batches(
        broker.settings, topics, batches, order, encoding=ENCODING, first_unconfirmed=0
    )


def _starts(seen: Collected, *, corrections: bool = False) -> set[int]:
    return {m["start"] - T for m in seen.windows if not corrections or m.get("correction")}


async def _scenario(
    broker: EmbeddedBroker, topics: Topics, tmp: Path, host: CombinerHost
) -> tuple[Collected, CombinerCounters]:
    settings = broker.settings
    data = _data()
    control = ControlClient(settings, topics, timeout_s=15)
    doomed = processes.pool_combiner(DOOMED, settings, topics, tmp / "state", tmp)
    sent: list[GeneratedBatch] = []
    async with collector(settings, topics, NAME) as seen:
        result = await control.request(Request("deploy", "d1", spec_toml=TEXT))
        assert result.ok, result.message
        assert await control.served(NAME, 1)
        await until(lambda: bool(host.owns()), 15, "the survivor owns the partition")
        sent += data["handed"]
        await send(broker, topics, data["handed"])
        await until(lambda: unapplied(sent, host) == [], 15, "the first batches applied")
        doomed.start()
        try:
            # The joiner wins the partition: the survivor lets go with a last checkpoint.
            await until(lambda: not host.owns(), 30, "the handover to the joining member")
            sent += data["ahead"]
            await send(broker, topics, data["ahead"])
            # All idle: a's windows close without b's and c's next rows (up to 33 s).
            await until(lambda: 30_000 in _starts(seen), 20, "the close while b and c are idle")
            sent += data["behind"]
            await send(broker, topics, data["behind"])
            await until(
                lambda: {12_000, 22_000} <= _starts(seen, corrections=True), 20, "corrections"
            )
            await asyncio.sleep(0.3)
            doomed.kill9()
        except BaseException:
            print(doomed.log_tail())
            raise
        finally:
            doomed.stop()
        await until(lambda: unapplied(sent, host) is not None, 10, "takeover after kill -9")
        # Re-sent in another order than first applied: b's and c's batches before a's.
        unconfirmed = [sent[i] for i in unapplied(sent, host) or []]
        await send(broker, topics, [b for b in unconfirmed if b.gateway_id != "a"])
        await asyncio.sleep(0.5)
        await send(broker, topics, [b for b in unconfirmed if b.gateway_id == "a"])
        async with resend_loop(
            settings, topics, sent, lambda b: unapplied(b, host), encoding=ENCODING
        ):
            await until(lambda: not host.terms[SLOT].runtime.chain.replaying, 20, "the replay")
            sent += data["after"]
            await send(broker, topics, data["after"])
            await until(lambda: unapplied(sent, host) == [], 20, "every batch applied")
            core = host.terms[SLOT].runtime.core
            await until(lambda: (core.closed_through or 0) >= THROUGH, 20, "the last close")
            await asyncio.sleep(0.5)  # the last results travel to the collector
    return seen, host.terms[SLOT].runtime.core.counters


@pytest.mark.timeout(150)
def test_a_pool_takeover_re_takes_the_dead_member_s_closes(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    settings = broker.settings
    workers = [
        Worker(WorkerConfig(None, settings, topics, worker_id=f"pool{i}", heartbeat_ms=200))
        for i in range(2)
    ]
    host = CombinerHost(
        HostConfig(
            settings, topics, tmp_path / "state", SURVIVOR, tick_ms=50, per_key_results=False
        )
    )

    async def run() -> tuple[Collected, CombinerCounters]:
        async with running_plane(settings, topics, SystemClock()), pool_running(*workers, host):
            return await _scenario(broker, topics, tmp_path, host)

    seen, counters = asyncio.run(asyncio.wait_for(run(), 140))
    batches = [b for phase in _data().values() for b in phase]
    rows = all_rows(batches)
    expected, late_count = expected_results(rows, SPEC)
    threshold = THROUGH
    # One content per (window, start, partition, revision), re-publications included.
    dedupe_identical(seen.windows)
    latest = seen.latest_frame().filter(pl.col("end") <= threshold)
    assert_matches_oracle(
        latest, expected.filter(pl.col("end") <= threshold), SPEC, scale_of(rows, SPEC)
    )
    assert seen.corrections() > 0
    late: dict[tuple[int, str, int], int] = {}
    for item in seen.late:  # re-applied batches report their late rows again, alike
        identity = (item["partition"], item["gateway_id"], item["seq"])
        assert late.setdefault(identity, item["rows"]) == item["rows"]
    assert late_count > 0
    assert sum(late.values()) == late_count
    assert counters.closes_replayed >= 1  # the dead member's closes were re-taken
    assert counters.replays_abandoned == 0
    assert counters.rows_corrected > 0
