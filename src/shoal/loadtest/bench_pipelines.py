"""``shoal bench pipelines``: many small pipelines on the pools, deployed, fed and counted.

One embedded Mosquitto; ``workers`` pool workers (``shoal worker`` without ``--pipeline``)
and one pool combiner (``shoal combiner`` without ``--pipeline``), each its own process
(``POLARS_MAX_THREADS=1``). ``count`` small pipelines (``bench_pool.spec_toml``: count and
mean over 10 s tumbling windows, one partition, all on the same input) are deployed by
retaining their documents as the control plane would (``Registry``), while a gateway
publishes a batch every ``interval_s`` (by default paced so that the pipelines together get
``BACKGROUND_PARTIALS_PER_S`` batches a second: every batch is one partial per pipeline for
the one pool combiner); then, in order:

1. ``deployed_s``: from the first document retained to every pool worker serving all of them
   and the combiner owning every partition;
2. ``first_result_s``: per pipeline, from its document retained to its first window result,
   minus the window size; the 99th percentile over the pipelines;
3. accounting: a second gateway publishes ``batches`` batches of ``rows`` measurements with
   timestamps in windows no earlier data reaches; once every pipeline confirmed the last one,
   every pipeline is flushed, and the rows each pipeline's results count for that gateway's
   windows are compared with what was published: ``lost_measurements`` (missing) and
   ``duplicated_measurements`` (counted more than once), summed over pipelines;
   ``achieved_meas_per_s`` is ``count x rows published`` over the time from the first
   publish to the last confirmation;
4. ``worker_rss_mb`` (the largest) and ``combiner_rss_mb``, at the end; the record also has
   their peaks over the whole run (``worker_rss_peak_mb``, ``combiner_rss_peak_mb``: sampled
   every ``RSS_EVERY_S``) and the processes' CPU seconds (``cpu_s``, by process).

The machine's load average is in the record (``machine``): the figures of a shared machine
are not a quiet machine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import psutil

from shoal._processes import ChildProcess, connection_args, shoal_argv
from shoal.broker import default_session_factory
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message, Session, unique_client_id
from shoal.control.assignment import Announcement
from shoal.control.registry import Registry
from shoal.errors import ControlError, ShoalError
from shoal.loadtest.bench_pipeline import machine
from shoal.loadtest.bench_pool import deploy_document
from shoal.schemas import Encoding, encode_batch
from shoal.schemas.control import Confirm, GatewayStatus
from shoal.schemas.topics import Topics

WINDOW_MS = 10_000
RSS_EVERY_S = 0.5
MIN_INTERVAL_S = 0.5
BACKGROUND_PARTIALS_PER_S = 200
"""The background gateway's default pace: its batches times the pipelines, per second."""
COMBINER_ID = "bench-pipelines"
KEYS = (
    "pipelines",
    "deployed_s",
    "first_result_s",
    "worker_rss_mb",
    "combiner_rss_mb",
    "achieved_meas_per_s",
    "lost_measurements",
    "duplicated_measurements",
)
"""The figures of the record (issue 15's names), in the order the report prints them."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What the bench runs.

    Attributes:
        count: pipelines deployed.
        workers: pool workers.
        batches: batches of the counting gateway (step 3).
        rows: measurements per batch.
        interval_s: the background gateway's pace while pipelines are deployed (None:
            ``count / BACKGROUND_PARTIALS_PER_S`` seconds, at least ``MIN_INTERVAL_S``).
        timeout_s: how long each step may take.
    """

    count: int = 1_000
    workers: int = 2
    batches: int = 20
    rows: int = 100
    interval_s: float | None = None
    timeout_s: float = 300.0

    @property
    def pace_s(self) -> float:
        """Seconds between two background batches."""
        if self.interval_s is not None:
            return self.interval_s
        return max(MIN_INTERVAL_S, self.count / BACKGROUND_PARTIALS_PER_S)


@contextlib.contextmanager
def _pools(config: BenchConfig) -> Iterator[tuple[EmbeddedBroker, Topics, list[ChildProcess]]]:
    """Broker, pool workers, pool combiner (last); all stopped and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-pipelines-") as tmp:
        folder = Path(tmp)
        broker = EmbeddedBroker("dev", data_dir=folder / "broker")
        broker.start()
        topics = Topics(root=f"bench-pipelines-{time.time_ns() % 10**9}")
        link = connection_args(broker.settings, topics)
        argvs = [(f"worker-{i}", ["worker", "--id", f"bench-w{i}"]) for i in range(config.workers)]
        state = str(folder / "state")
        combiner = ["combiner", "--id", COMBINER_ID, "--state-dir", state, "--no-key-topics"]
        argvs.append(("combiner", combiner))
        children = [
            ChildProcess(
                name, shoal_argv(*argv, *link), folder / f"{name}.log", {"POLARS_MAX_THREADS": "1"}
            )
            for name, argv in argvs
        ]
        try:
            for child in children:
                child.start()
            yield broker, topics, children
        finally:
            for child in children:
                child.stop()
            broker.close()


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the bench; the JSON record."""
    with _pools(config) as (broker, topics, children):
        figures = asyncio.run(_measure(config, broker, topics, children))
    return {"bench": "pipelines", "machine": machine(), "config": _config(config), **figures}


def _config(config: BenchConfig) -> dict[str, Any]:
    return {
        "count": config.count,
        "workers": config.workers,
        "batches": config.batches,
        "rows": config.rows,
        "interval_s": config.pace_s,
        "timeout_s": config.timeout_s,
        "window_ms": WINDOW_MS,
    }


class _Seen:
    """What the bench hears: heartbeats, announcements, confirmations, results."""

    def __init__(self, topics: Topics) -> None:
        self.topics = topics
        self.serving: dict[str, int] = {}  # pool worker -> pipelines served
        self.owned = 0
        self.first_result: dict[str, float] = {}  # pipeline -> when
        self.confirmed: dict[tuple[str, str], int] = {}  # (gateway, pipeline) -> seq
        self.windows: dict[tuple[str, int, int, int], int] = {}  # counting gateway's windows
        self.copies: dict[tuple[str, int, int, int], int] = {}
        self.count_from_ms = 2**62

    def take(self, message: Message) -> None:
        t = self.topics
        topic = message.topic
        if not message.payload:
            return
        if topic.startswith(t.metrics("worker", "")):
            body = orjson.loads(message.payload)
            if isinstance(body.get("serving"), dict):
                self.serving[str(body["id"])] = len(body["serving"])
        elif topic == t.pool_combiner(COMBINER_ID):
            with contextlib.suppress(ControlError):
                self.owned = len(Announcement.from_json(message.payload).owns)
        elif topic.startswith(t.confirm_all()[:-1]):
            confirm = Confirm.from_json(message.payload)
            self.confirmed[(confirm.gateway_id, confirm.pipeline)] = confirm.seq
        else:
            body = orjson.loads(message.payload)
            name = str(body["pipeline"])
            self.first_result.setdefault(name, time.perf_counter())
            if int(body["start"]) >= self.count_from_ms:
                identity = (name, int(body["start"]), int(body["partition"]), body["revision"])
                self.copies[identity] = self.copies.get(identity, 0) + 1
                self.windows[identity] = int(body["rows"])


async def _measure(
    config: BenchConfig, broker: EmbeddedBroker, topics: Topics, children: list[ChildProcess]
) -> dict[str, Any]:
    seen = _Seen(topics)
    registry = Registry()
    async with default_session_factory()(broker.settings, unique_client_id("bench")) as session:
        await session.subscribe(
            [
                topics.metrics("worker", "+"),
                topics.pool_combiner(COMBINER_ID),
                topics.confirm_all(),
                topics.results("+"),
            ],
            qos=1,
        )
        listener = asyncio.create_task(_listen(session, seen))
        peaks = [0.0] * len(children)
        sampler = asyncio.create_task(_sample_rss(children, peaks))
        background = asyncio.create_task(_steady(session, topics, config.pace_s))
        try:
            deployed_at: dict[str, float] = {}
            started = time.perf_counter()
            for index in range(config.count):
                deployed_at[f"p{index:05d}"] = time.perf_counter()
                await deploy_document(session, topics, registry, index)
            await _until(
                lambda: (
                    len(seen.serving) == config.workers
                    and all(n == config.count for n in seen.serving.values())
                    and seen.owned == config.count
                ),
                config.timeout_s,
                children,
                lambda: (
                    f"every pipeline served and owned (served {seen.serving}, owned {seen.owned})"
                ),
            )
            deployed_s = time.perf_counter() - started
            await _until(
                lambda: len(seen.first_result) >= config.count,
                config.timeout_s,
                children,
                lambda: f"a first result of every pipeline ({len(seen.first_result)} had one)",
            )
            waits = sorted(seen.first_result[n] - t for n, t in deployed_at.items())
            first_result_s = _p99(waits) - WINDOW_MS / 1000
            background.cancel()
            figures = await _account(config, session, topics, seen, children)
            processes = [psutil.Process(c.pid) for c in children]
            rss = [p.memory_info().rss / 2**20 for p in processes]
            cpu = {
                c.name: round(sum(p.cpu_times()[:2]), 1)
                for c, p in zip(children, processes, strict=True)
            }
        finally:
            background.cancel()
            listener.cancel()
            sampler.cancel()
    return {
        "pipelines": config.count,
        "deployed_s": round(deployed_s, 3),
        "first_result_s": round(first_result_s, 3),
        "worker_rss_mb": round(max(rss[:-1]), 1),
        "combiner_rss_mb": round(rss[-1], 1),
        **figures,
        "worker_rss_peak_mb": round(max(peaks[:-1]), 1),
        "combiner_rss_peak_mb": round(peaks[-1], 1),
        "cpu_s": cpu,
    }


async def _sample_rss(children: list[ChildProcess], peaks: list[float]) -> None:
    """Each child's largest RSS so far, every ``RSS_EVERY_S``."""
    processes = [psutil.Process(c.pid) for c in children]
    while True:
        for index, process in enumerate(processes):
            with contextlib.suppress(psutil.Error):
                peaks[index] = max(peaks[index], process.memory_info().rss / 2**20)
        await asyncio.sleep(RSS_EVERY_S)


async def _account(
    config: BenchConfig,
    session: Session,
    topics: Topics,
    seen: _Seen,
    children: list[ChildProcess],
) -> dict[str, Any]:
    """Step 3: a known set of rows into fresh windows; each pipeline's count of them."""
    await asyncio.sleep(config.pace_s * 2)  # the background gateway's last batch lands
    now = int(time.time() * 1000)
    base = (now // WINDOW_MS + 2) * WINDOW_MS  # windows no earlier data reaches
    seen.count_from_ms = base
    gateway = "gw-count"
    status = GatewayStatus(gateway, "s", config.batches, 0, config.batches, 0, None, 0, 0, now)
    await session.publish(topics.gateway_status(gateway), status.to_json(), qos=1, retain=True)
    started = time.perf_counter()
    for seq in range(config.batches):
        frame = pl.DataFrame(
            {
                "sensor_id": [f"k{i % 10}" for i in range(config.rows)],
                "ts": [base + seq * 100 + i % 100 for i in range(config.rows)],
                "value": [float(i) for i in range(config.rows)],
            }
        )
        payload = encode_batch(
            frame, gateway_id=gateway, seq=seq, sent_at_ms=now, encoding=Encoding.JSON_ROWS
        )
        await session.publish(topics.ingest("s", gateway), payload, qos=1)
    last = config.batches - 1
    names = [f"p{i:05d}" for i in range(config.count)]
    await _until(
        lambda: all(seen.confirmed.get((gateway, n), -1) >= last for n in names),
        config.timeout_s,
        children,
        "every pipeline confirmed the counted batches",
    )
    elapsed = time.perf_counter() - started
    for name in names:
        await session.publish(topics.combiner_control(name), b'{"cmd": "flush"}', qos=1)
    published = config.batches * config.rows
    await _until(
        lambda: _rows_by_pipeline(seen, names) == dict.fromkeys(names, published),
        30.0,
        children,
        "every counted row in a result",
        fail=False,
    )
    counted = _rows_by_pipeline(seen, names)
    return {
        "achieved_meas_per_s": round(published * config.count / elapsed, 1),
        "lost_measurements": sum(max(0, published - counted[n]) for n in names),
        "duplicated_measurements": sum(max(0, counted[n] - published) for n in names)
        + sum(seen.windows[i] * (c - 1) for i, c in seen.copies.items() if c > 1),
    }


def _rows_by_pipeline(seen: _Seen, names: list[str]) -> dict[str, int]:
    out = dict.fromkeys(names, 0)
    for (name, *_), rows in list(seen.windows.items()):
        out[name] = out.get(name, 0) + rows
    return out


async def _steady(session: Session, topics: Topics, interval_s: float) -> None:
    """A gateway publishing a small batch every ``interval_s`` (results appear as they do).

    It has no spool: before each batch it announces every earlier one as confirmed, so a
    partition that started after some of them (a pipeline deployed meanwhile) skips them
    instead of waiting for re-sends that never come. Its rows are not counted.
    """
    gateway = "gw-steady"
    seq = 0
    while True:
        now = int(time.time() * 1000)
        status = GatewayStatus(gateway, "s", seq, seq, 0, 0, None, 0, 0, now)
        await session.publish(topics.gateway_status(gateway), status.to_json(), qos=1, retain=True)
        frame = pl.DataFrame({"sensor_id": ["s0", "s1"], "ts": [now, now], "value": [1.0, 2.0]})
        payload = encode_batch(
            frame, gateway_id=gateway, seq=seq, sent_at_ms=now, encoding=Encoding.JSON_ROWS
        )
        await session.publish(topics.ingest("s", gateway), payload, qos=1)
        seq += 1
        await asyncio.sleep(interval_s)


async def _listen(session: Session, seen: _Seen) -> None:
    async for message in session.messages():
        with contextlib.suppress(ValueError, KeyError, TypeError, ShoalError):
            seen.take(message)


async def _until(
    check: Any,
    timeout_s: float,
    children: list[ChildProcess],
    what: str | Callable[[], str],
    *,
    fail: bool = True,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [c for c in children if not c.alive()]
        if dead:
            raise ShoalError(f"{dead[0].name} died; its log ends:\n{dead[0].log_tail()}")
        if time.monotonic() > deadline:
            if fail:
                said = what() if callable(what) else what
                raise ShoalError(f"bench pipelines: {said}: not within {timeout_s:g} s")
            return
        await asyncio.sleep(0.1)


def _p99(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def format_report(record: dict[str, Any]) -> str:
    """One line per figure."""
    lines = [f"{key:<24} {record[key]}" for key in KEYS]
    lines.append(f"{'worker_rss_peak_mb':<24} {record['worker_rss_peak_mb']}")
    lines.append(f"{'combiner_rss_peak_mb':<24} {record['combiner_rss_peak_mb']}")
    lines.append(f"{'load average':<24} {record['machine']['load_average']}")
    return "\n".join(lines)
