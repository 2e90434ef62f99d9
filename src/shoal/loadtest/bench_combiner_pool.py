"""``shoal bench pool --combiner``: a pool combiner's memory per hosted partition.

One embedded Mosquitto and one pool combiner (``shoal combiner`` without ``--pipeline``, its
own process, ``POLARS_MAX_THREADS=1``), alone in the pool, so it owns every partition. The
pipelines of ``bench_pool`` (one partition each) are deployed by retaining their documents,
up to each count in turn; at each count the bench waits until the combiner's retained
announcement (``shoal/combiners/<id>``) lists them all (each partition's session taken and
its checkpoint folder locked and read), lets it settle, and reads its RSS. No data flows:
this is the fixed cost of hosting a partition (connection, runtime, tasks, empty state).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from shoal._processes import ChildProcess
from shoal.broker import default_session_factory
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.control.assignment import Announcement
from shoal.control.registry import Registry
from shoal.errors import ControlError, ShoalError
from shoal.loadtest.bench_pipeline import machine
from shoal.loadtest.bench_pool import alone_with_a_broker, deploy_document, kb_each_over_first
from shoal.schemas.topics import Topics

COMBINER_ID = "bench-pool"
SETTLE_S = 3.0


@dataclass(frozen=True, slots=True)
class HostStep:
    """The pool combiner with ``pipelines`` deployed (one partition each).

    Attributes:
        pipelines: how many are deployed (and owned).
        rss_mb: the combiner's resident memory once it owns them all.
        owned_s: from the first document of this step retained to the announcement listing
            them all.
        threads: the process's threads.
        idle_cpu_percent: its CPU use while idle (no data flows) over the settle time:
            every hosted partition ticks and beats.
    """

    pipelines: int
    rss_mb: float
    owned_s: float
    threads: int
    idle_cpu_percent: float


def run(counts: list[int]) -> list[HostStep]:
    """Measure the pool combiner at each of ``counts`` deployed pipelines (ascending)."""

    def argv(folder: Path) -> list[str]:
        state = str(folder / "state")
        return ["combiner", "--id", COMBINER_ID, "--state-dir", state, "--no-key-topics"]

    with alone_with_a_broker("pool-combiner", argv) as (broker, topics, combiner):
        return asyncio.run(_measure(broker, topics, combiner, sorted(counts)))


async def _measure(
    broker: EmbeddedBroker, topics: Topics, combiner: ChildProcess, counts: list[int]
) -> list[HostStep]:
    process = psutil.Process(combiner.pid)
    registry = Registry()
    owned: list[int] = [0]
    steps = []
    async with default_session_factory()(broker.settings, unique_client_id("bench")) as session:
        await session.subscribe([topics.pool_combiner(COMBINER_ID)], qos=1)

        async def listen() -> None:
            async for message in session.messages():
                try:
                    owned[0] = len(Announcement.from_json(message.payload).owns)
                except ControlError:
                    continue  # cleared

        listener = asyncio.create_task(listen())
        try:
            deployed = 0
            for count in counts:
                started = time.perf_counter()
                while deployed < count:
                    await deploy_document(session, topics, registry, deployed)
                    deployed += 1
                deadline = time.monotonic() + 60 + count / 10
                while owned[0] < count:
                    if time.monotonic() > deadline or not combiner.alive():
                        raise ShoalError(
                            f"the pool combiner owned {owned[0]} of {count} in time; its log "
                            f"ends:\n{combiner.log_tail()}"
                        )
                    await asyncio.sleep(0.05)
                owned_s = time.perf_counter() - started
                process.cpu_percent()
                await asyncio.sleep(SETTLE_S)
                cpu = round(process.cpu_percent(), 1)
                rss_mb = round(process.memory_info().rss / 2**20, 1)
                steps.append(HostStep(count, rss_mb, owned_s, process.num_threads(), cpu))
        finally:
            listener.cancel()
    return steps


def format_report(steps: list[HostStep]) -> str:
    """A table: RSS and the cost per partition over the first step."""
    lines = ["pipelines   RSS MB   KB/partition (over the first)   owned s   idle CPU %"]
    first = steps[0]
    for step in steps:
        per = kb_each_over_first(step.pipelines, step.rss_mb, first.pipelines, first.rss_mb)
        lines.append(
            f"{step.pipelines:>9}   {step.rss_mb:>6.1f}   {per:>29.1f}   "
            f"{step.owned_s:>7.2f}   {step.idle_cpu_percent:>10.1f}"
        )
    return "\n".join(lines)


def as_record(steps: list[HostStep]) -> dict[str, Any]:
    """The JSON record."""
    return {
        "bench": "pool-combiner",
        "machine": machine(),
        "steps": [asdict(step) for step in steps],
    }
