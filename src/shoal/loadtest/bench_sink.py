"""``shoal bench sink``: scenario A through ``shoal sink postgres`` under kill -9 and a restart.

A ``LocalPipeline`` (broker, combiners, workers as processes) runs ``SINK_PIPELINE`` while
``shoal simulate --scenario A`` offers 1 gateway x 1,000 sensors for ``duration_s``. Two
``shoal sink postgres`` processes follow its results into a throwaway PostgreSQL server
(``shoal.loadtest.postgres``):

* the **faulted** sink, killed -9 at 30 % and 70 % of the run (started again after
  ``down_s``), while the database is killed -9 and restarted at 50 %;
* the **capacity** sink, which subscribes first (creating its persistent session) and then
  stops: the broker keeps the whole run's results for it. After the run it starts and drains
  that backlog; rows it writes per second of draining is the sink's throughput
  (windows x keys per second, one commit per window message).

The oracle: every window message on ``results/<pipeline>`` as a consumer with its own
session saw it, reduced to the latest revision of each (window, start, key)
(``latest_revisions``). Both tables must equal it exactly (every column the results carry)
with no duplicate rows; the pipeline's own count accounting must be exact too.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

import polars as pl
import psycopg
from psycopg import sql

from shoal._processes import ChildProcess
from shoal.broker import AsyncSession
from shoal.broker.session import unique_client_id
from shoal.errors import BrokerError
from shoal.loadtest.postgres import EmbeddedPostgres, read_table, sink_argv
from shoal.processors.spec import load_pipeline
from shoal.runtime.local import LocalPipeline, LocalPipelineConfig
from shoal.schemas.results import latest_revisions, parse_window_message

SINK_PIPELINE: Final = """\
# The pipeline of `shoal bench sink`: scenario A's 1,000 sensors in 1 s tumbling and
# 2 s / 1 s hopping windows (3,000 result rows a second), two combiner partitions.
name = "sinkbench"
inputs = ["ingest/+/+"]
key = "sensor_id"
lateness_ms = 500
idle_timeout_ms = 3000
partitions = 2
checkpoint_interval_ms = 500
output_encodings = ["json"]
aggregates = ["count", "mean", "min", "max", "stddev", "p50", "p99"]

[[windows]]
kind = "tumbling"
size_ms = 1000

[[windows]]
kind = "hopping"
size_ms = 2000
slide_ms = 1000
"""

COMPARED: Final = ("window", "start", "end", "key", "revision", "partition", "rows", "batches")


@dataclass(frozen=True, slots=True)
class SinkBenchConfig:
    """One run.

    Attributes:
        duration_s: how long the simulator offers load.
        rate: measurements per second per sensor (scenario A: 1,000 sensors).
        batch: rows per batch.
        workers: worker processes.
        down_s: how long a killed sink stays dead.
        faults: inject the kills and the database restart.
        run_dir: logs and state (None: a temporary folder, removed afterwards).
    """

    duration_s: float = 60.0
    rate: float = 25.0
    batch: int = 16_000
    workers: int = 2
    down_s: float = 2.0
    faults: bool = True
    run_dir: Path | None = None


def _sink(local: LocalPipeline, dsn: str, table: str, json_path: Path) -> ChildProcess:
    return ChildProcess(
        f"sink-{table}",
        sink_argv(
            dsn,
            "sinkbench",
            table,
            local.broker.settings,
            local.topics,
            "--client-id",
            f"bench-sink-{table}",
            "--heartbeat",
            "5",
            "--json",
            str(json_path),
        ),
        local.logs / f"sink-{table}.log",
    )


def _subscribed(child: ChildProcess, times: int = 1) -> bool:
    try:
        return child.log_path.read_text().count(": following ") >= times
    except OSError:
        return False


async def _wait(done: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(done):
            return
        await asyncio.sleep(0.2)
    raise BrokerError(f"bench sink: timed out waiting for {what}")


def _table_rows(dsn: str, table: str) -> int:
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            query = sql.SQL("SELECT coalesce(sum(rows), 0) FROM {}").format(sql.Identifier(table))
            row = conn.execute(query).fetchone()
    except psycopg.Error:
        return -1  # not there yet, or the database is restarting
    return int(row[0]) if row else 0


def compare(table: pl.DataFrame, oracle: pl.DataFrame) -> dict[str, Any]:
    """Rows missing from / extra in / differing in the table, and duplicate keys."""
    key = ["window", "start", "key"]
    aggregates = [c for c in oracle.columns if c not in (*COMPARED, "pipeline")]
    columns = [*COMPARED, *[c for c in aggregates if c in table.columns]]
    if table.height == 0:
        return {"rows": 0, "missing": oracle.height, "extra": 0, "different": 0, "duplicates": 0}
    got = table.select(columns)
    want = oracle.select(columns)
    duplicates = got.height - got.select(key).unique().height
    missing = want.join(got, on=key, how="anti").height
    extra = got.join(want, on=key, how="anti").height
    different = want.join(got, on=columns, how="anti", nulls_equal=True).height - missing
    return {
        "rows": got.height,
        "missing": missing,
        "extra": extra,
        "different": different,
        "duplicates": duplicates,
    }


def run_sink_bench(config: SinkBenchConfig, progress: TextIO | None = None) -> dict[str, Any]:
    """Run once; returns the JSON record (see the module docstring)."""
    run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="shoal-bench-sink-"))
    spec_path = run_dir / "sinkbench.toml"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(SINK_PIPELINE)
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=load_pipeline(spec_path),
            spec_source=str(spec_path),
            workers=config.workers,
            per_key_results=False,
            run_dir=run_dir / "pipeline",
        )
    )
    postgres = EmbeddedPostgres()  # its own temporary folder, reachable by its user
    try:
        postgres.start()
        local.start()
        return asyncio.run(_measure(local, postgres, config, run_dir, progress))
    finally:
        local.stop()
        postgres.cleanup()
        if config.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


async def _consume(local: LocalPipeline, frames: list[pl.DataFrame], ready: asyncio.Event) -> None:
    """The oracle's consumer: every window message, through broker restarts."""
    topic = local.topics.results("sinkbench")
    client_id = unique_client_id("bench-sink-oracle")
    while True:
        session = AsyncSession(
            local.broker.settings, client_id, clean_start=False, session_expiry_s=3600
        )
        try:
            async with session:
                await session.subscribe([topic], qos=1)
                ready.set()
                # one at a time: a comprehension would lose its part when the link drops
                async for message in session.messages():
                    frames.append(parse_window_message(message.payload).frame)  # noqa: PERF401
        except BrokerError:
            await asyncio.sleep(0.3)


async def _inject(
    faulted: ChildProcess,
    *,
    postgres: EmbeddedPostgres,
    config: SinkBenchConfig,
    started: float,
    faults: list[dict[str, Any]],
    progress: TextIO | None,
) -> None:
    """Kill the sink at 30 % and 70 % of the run, restart the database at 50 %."""
    plan = [(0.3, "kill sink"), (0.5, "restart postgres"), (0.7, "kill sink")]
    for share, fault in plan:
        due = started + share * config.duration_s
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        at = round(time.monotonic() - started, 1)
        written = await asyncio.to_thread(_table_rows, postgres.dsn, "faulted")
        if fault == "kill sink":
            faulted.kill()
            await asyncio.sleep(config.down_s)
            faulted.start()
        else:
            await asyncio.to_thread(postgres.restart, 0.5)
        faults.append({"at_s": at, "fault": fault, "measurements_in_table": written})
        _say(progress, f"{fault} at {at} s ({written:,} measurements in the table)")


def _say(progress: TextIO | None, text: str) -> None:
    if progress is not None:
        print(f"bench sink: {text}", file=progress, flush=True)


async def _measure(
    local: LocalPipeline,
    postgres: EmbeddedPostgres,
    config: SinkBenchConfig,
    run_dir: Path,
    progress: TextIO | None,
) -> dict[str, Any]:
    faulted = _sink(local, postgres.dsn, "faulted", run_dir / "sink-faulted.json")
    capacity = _sink(local, postgres.dsn, "capacity", run_dir / "sink-capacity.json")
    for sink in (faulted, capacity):
        sink.start()
    await _wait(lambda: _subscribed(faulted) and _subscribed(capacity), 60, "the sinks")
    capacity.stop()  # its session keeps everything from now on
    frames: list[pl.DataFrame] = []
    ready = asyncio.Event()
    consumer = asyncio.create_task(_consume(local, frames, ready))
    await asyncio.wait_for(ready.wait(), 10)
    faults: list[dict[str, Any]] = []
    started = time.monotonic()
    async with local.watching() as session:
        local.start_simulator(
            [
                "--scenario",
                "A",
                "--rate",
                str(config.rate),
                "--batch",
                str(config.batch),
                "--duration",
                str(config.duration_s),
                "--spool",
                "memory",
                "--quiet",
            ]
        )
        _say(progress, f"scenario A for {config.duration_s:.0f} s")
        if config.faults:
            await _inject(
                faulted,
                postgres=postgres,
                config=config,
                started=started,
                faults=faults,
                progress=progress,
            )
        await asyncio.sleep(max(0.0, started + config.duration_s - time.monotonic()))
        accounting = await local.settle(session)
    await asyncio.sleep(1.0)  # the last results reach the consumer
    consumer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consumer
    oracle = latest_revisions(pl.concat(frames, how="diagonal_relaxed"))
    want_rows = int(oracle["rows"].sum())
    _say(progress, f"pipeline settled; {oracle.height:,} result rows; waiting for the sinks")
    await _wait(lambda: _table_rows(postgres.dsn, "faulted") >= want_rows, 180, "the faulted sink")
    # Capacity: drain the whole run's backlog.
    capacity.start()
    await _wait(lambda: _subscribed(capacity, 2), 60, "the capacity sink to subscribe")
    drain_started = time.monotonic()
    await _wait(
        lambda: _table_rows(postgres.dsn, "capacity") >= want_rows, 600, "the capacity sink"
    )
    drain_s = time.monotonic() - drain_started
    faulted.stop()
    capacity.stop()
    tables = {
        name: compare(await asyncio.to_thread(read_table, postgres.dsn, name), oracle)
        for name in ("faulted", "capacity")
    }
    exact = all(
        t["missing"] == t["extra"] == t["different"] == t["duplicates"] == 0
        for t in tables.values()
    )
    return {
        "bench": "sink",
        "scenario": "A",
        "duration_s": config.duration_s,
        "rate_per_sensor": config.rate,
        "batch": config.batch,
        "faults": faults,
        "result_messages": len(frames),
        "result_rows": oracle.height,
        "windows_per_s": round(oracle.height / config.duration_s, 1),
        "tables": tables,
        "exact": exact and accounting.exact,
        "pipeline_exact": accounting.exact,
        "capacity_drain_s": round(drain_s, 2),
        "sink_rows_per_s": round(oracle.height / drain_s, 1) if drain_s > 0 else None,
        "sink_messages_per_s": round(len(frames) / drain_s, 1) if drain_s > 0 else None,
    }
