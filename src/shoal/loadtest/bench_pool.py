"""``shoal bench pool``: a pool worker's memory per deployed pipeline, and its pick-up time.

One embedded Mosquitto, one pool worker (``shoal worker`` without ``--pipeline``) as its own
process. Small pipelines (count and mean over a 10 s tumbling window, one partition, all on
the same input) are deployed by retaining their documents, made by the control plane's own
``Registry`` (the control plane itself is left out: it is not what is measured), up to each
count in turn. At each count the bench waits until the worker's heartbeat serves them all,
publishes one batch (so every pipeline's handler has built partials once) and waits until the
worker handled it once per pipeline, then reads the worker's RSS. Partials go to no combiner
(the broker drops them).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import psutil

from shoal._processes import ChildProcess, connection_args, shoal_argv
from shoal.broker import default_session_factory
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Session, unique_client_id
from shoal.control.messages import Request
from shoal.control.registry import Registry
from shoal.errors import ShoalError
from shoal.loadtest.bench_pipeline import machine
from shoal.schemas import Encoding, encode_batch
from shoal.schemas.topics import Topics

WORKER_ID = "bench-pool"


@dataclass(frozen=True, slots=True)
class PoolStep:
    """The pool worker with ``pipelines`` deployed.

    Attributes:
        pipelines: how many are deployed.
        rss_mb: the worker's resident memory, after every pipeline handled one batch.
        served_s: from the first document of this step retained to the heartbeat that
            serves them all.
        handled_s: from the batch published to every pipeline having handled it.
    """

    pipelines: int
    rss_mb: float
    served_s: float
    handled_s: float


def spec_toml(index: int) -> str:
    """A small pipeline; every one reads the same input, so one batch reaches them all.

    Each has its own limit on key lengths (256 bytes and up, never reached): otherwise they
    would be the same spec under other names, and the control plane would make every one
    after the first an alias of it, computed once (CONTRACT.md §22.4).
    """
    return (
        f'name = "p{index:05d}"\naggregates = ["count", "mean"]\n'
        f"limits = {{ max_string_bytes = {256 + index} }}\n[[windows]]\nsize_ms = 10000\n"
    )


@contextlib.contextmanager
def alone_with_a_broker(
    name: str, argv: Callable[[Path], list[str]]
) -> Iterator[tuple[EmbeddedBroker, Topics, ChildProcess]]:
    """An embedded Mosquitto and one ``shoal`` process (``POLARS_MAX_THREADS=1``) beside it.

    ``argv(folder)`` is the sub-command and its options (the connection's are added); the
    process's log and any state go into a temporary folder, removed afterwards.
    """
    with tempfile.TemporaryDirectory(prefix=f"shoal-bench-{name}-") as tmp:
        folder = Path(tmp)
        broker = EmbeddedBroker("dev", data_dir=folder / "broker")
        broker.start()
        topics = Topics(root=f"bench-{name}-{time.time_ns() % 10**9}")
        child = ChildProcess(
            name,
            shoal_argv(*argv(folder), *connection_args(broker.settings, topics)),
            folder / f"{name}.log",
            {"POLARS_MAX_THREADS": "1"},
        )
        try:
            child.start()
            yield broker, topics, child
        finally:
            child.stop()
            broker.close()


def kb_each_over_first(count: int, rss_mb: float, first_count: int, first_rss_mb: float) -> float:
    """Memory per pipeline (or partition) added since the first step, in KB (NaN at it)."""
    extra = count - first_count
    return (rss_mb - first_rss_mb) * 1024 / extra if extra > 0 else float("nan")


def run(counts: list[int]) -> list[PoolStep]:
    """Measure the pool worker at each of ``counts`` deployed pipelines (ascending)."""
    with alone_with_a_broker("pool-worker", lambda _: ["worker", "--id", WORKER_ID]) as (
        broker,
        topics,
        worker,
    ):
        return asyncio.run(_measure(broker, topics, worker, sorted(counts)))


async def _measure(
    broker: EmbeddedBroker, topics: Topics, worker: ChildProcess, counts: list[int]
) -> list[PoolStep]:
    factory = default_session_factory()
    process = psutil.Process(worker.pid)
    registry = Registry()
    beats: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    steps = []
    async with factory(broker.settings, unique_client_id("bench-pool")) as session:
        await session.subscribe([topics.metrics("worker", WORKER_ID)], qos=0)
        listener = asyncio.create_task(_listen(session, beats))
        try:
            beat = await _beat(beats, worker, lambda _: True, timeout_s=30)
            deployed = 0
            for seq, count in enumerate(counts):
                started = time.perf_counter()
                while deployed < count:
                    await deploy_document(session, topics, registry, deployed)
                    deployed += 1
                await _beat(beats, worker, lambda b, n=count: len(b["serving"]) == n)
                served_s = time.perf_counter() - started
                before = beat["batches"]
                started = time.perf_counter()
                await session.publish(topics.ingest("s", "gw0"), _batch(seq))
                beat = await _beat(beats, worker, lambda b, n=before + count: b["batches"] >= n)
                handled_s = time.perf_counter() - started
                rss_mb = process.memory_info().rss / 2**20
                steps.append(PoolStep(count, round(rss_mb, 1), served_s, handled_s))
        finally:
            listener.cancel()
    return steps


async def _listen(session: Session, beats: asyncio.Queue[dict[str, Any]]) -> None:
    async for message in session.messages():
        body = orjson.loads(message.payload)
        if body.get("state") != "gone":
            beats.put_nowait(body)


async def _beat(
    beats: asyncio.Queue[dict[str, Any]],
    worker: ChildProcess,
    wanted: Any,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not worker.alive():
            raise ShoalError(
                f"the pool worker did not get there in time; its log ends:\n{worker.log_tail()}"
            )
        try:
            body = await asyncio.wait_for(beats.get(), left)
        except TimeoutError:
            continue
        if wanted(body):
            return body


async def deploy_document(session: Session, topics: Topics, registry: Registry, index: int) -> None:
    """Retain the document of pipeline ``index`` as the control plane would."""
    request = Request("deploy", f"bench-{index}", spec_toml=spec_toml(index))
    result, document = registry.decide(request, int(time.time() * 1000))
    if document is None:
        raise ShoalError(f"the bench's own spec was refused: {result.message}")
    await session.publish(
        topics.pipeline_document(document.name), document.to_json(), qos=1, retain=True
    )
    registry.commit(document)


def _batch(seq: int) -> bytes:
    now = int(time.time() * 1000)
    frame = pl.DataFrame(
        {
            "sensor_id": [f"k{i % 10}" for i in range(100)],
            "ts": [now - 1_000 + i for i in range(100)],
            "value": [float(i) for i in range(100)],
        }
    )
    return encode_batch(
        frame, gateway_id="gw0", seq=seq, sent_at_ms=now, encoding=Encoding.JSON_ROWS
    )


def format_report(steps: list[PoolStep]) -> str:
    """A table: RSS and the cost per pipeline over the first step."""
    lines = ["pipelines   RSS MB   KB/pipeline (over the first)   served s   handled s"]
    first = steps[0]
    for step in steps:
        per = kb_each_over_first(step.pipelines, step.rss_mb, first.pipelines, first.rss_mb)
        lines.append(
            f"{step.pipelines:>9}   {step.rss_mb:>6.1f}   {per:>28.1f}   "
            f"{step.served_s:>8.2f}   {step.handled_s:>9.2f}"
        )
    return "\n".join(lines)


def as_record(steps: list[PoolStep]) -> dict[str, Any]:
    """The JSON record."""
    return {"bench": "pool", "machine": machine(), "steps": [asdict(step) for step in steps]}
