"""Bad gateway clocks through a real broker (issue 14): bounded hold, clamping, accounting.

Three gateways publish at once: one on time, one whose clock runs an hour ahead, one whose
clock runs an hour behind (accepted, but an hour behind everyone). With the default policy
every batch of the gateway ahead is refused (timestamps too far in the future); with
``on_future = "clamp"`` its rows are kept, clamped to the workers' clock and counted. Before
the bounded hold, refused batches counted as progress without event time and the gateway
behind held the pipeline watermark an hour back: no window of the on-time gateway closed
until a flush. Now neither may hold the others' windows for longer than ``max_hold_ms``.

Every measurement the simulators sealed is accounted for from what the pipeline published,
not from its own counters: in a window result, reported late, or in a dead-lettered batch.
The on-time gateway also sends a share of late rows (``--late-share``).

The bound is measured on the windows that the on-time gateway's own event time closes: those
ending at least ``lateness_ms`` before the last measurement it sent, which the test reads from
its batches on the broker. Its last one or two windows are closed by the flush that ends the
run (nothing later of it passes them), whenever the test gets to that: under load, seconds
after their end. They are checked to close there, not measured against the bound.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest

from shoal._cli.common import load_spec
from shoal.broker import AsyncSession
from shoal.broker.session import Message, unique_client_id
from shoal.processors.results import late_memberships
from shoal.runtime.local import Accounting, LocalPipeline, LocalPipelineConfig
from shoal.schemas import decode_batch

pytestmark = pytest.mark.broker

LATENESS_MS = 500
MAX_HOLD_MS = 3_000
MAX_DELAY_MS = 500  # gateways seal a batch at least this often
HOUR_MS = 3_600_000
LATE_SHARE = 0.02  # of the on-time gateway's rows, stamped LATE_BY_MS back
LATE_BY_MS = 20_000


def spec_text(on_future: str) -> str:
    return f"""
name = "skew"
inputs = ["ingest/+/+"]
key = "sensor_id"
lateness_ms = {LATENESS_MS}
idle_timeout_ms = 2000
max_hold_ms = {MAX_HOLD_MS}
checkpoint_interval_ms = 500
aggregates = ["count", "mean"]

[[windows]]
kind = "tumbling"
size_ms = 1000

[limits]
max_future_ms = 300000
on_future = "{on_future}"
"""


GATEWAYS = {"ok-gw": 0, "ahead-gw": HOUR_MS, "behind-gw": -HOUR_MS}
ON_TIME_GATEWAY = "ok-gw000"
RUN_ON_S = 120.0
"""How long the simulators may go on after ``load_s``: the test stops them once it has read
``shoal status`` (which must see the on-time gateway still sending), however long that took."""
STREAM = "sim"


@dataclass
class Published:
    """What the pipeline published, counted by a plain subscriber."""

    results: list[dict[str, Any]] = field(default_factory=list)
    late_rows: dict[str, int] = field(default_factory=dict)
    """Late measurements by gateway."""
    deadlettered: dict[tuple[str, int], int] = field(default_factory=dict)
    """Rows of each dead-lettered batch, by (gateway, seq): a re-sent one counts once."""
    reasons: set[str] = field(default_factory=set)
    on_time_last_ts: int | None = None
    """The largest event time the on-time gateway published (its batches, read on the broker)."""

    def take(self, message: Message, topics: Any) -> None:
        if message.topic == topics.ingest(STREAM, ON_TIME_GATEWAY):
            ts = decode_batch(message.payload, content_type=message.content_type).ts
            last = int(ts.max()) if len(ts) else None
            if last is not None and (self.on_time_last_ts is None or last > self.on_time_last_ts):
                self.on_time_last_ts = last
        elif message.topic == topics.results("skew"):
            body = orjson.loads(message.payload)
            self.results.append({k: body[k] for k in ("start", "end", "emitted_at", "rows")})
        elif message.topic == topics.late("skew"):
            # One tumbling window spec: a late row is one window membership.
            body = orjson.loads(message.payload)
            gateway = body["gateway_id"]
            self.late_rows[gateway] = self.late_rows.get(gateway, 0) + late_memberships(body, None)
        elif message.topic == topics.deadletter("skew"):
            record = msgpack.unpackb(message.payload, raw=False)
            assert not record["payload_truncated"], record["error"]
            self.reasons.add(record["error"]["reason"])
            batch = decode_batch(record["payload"], content_type=record["content_type"])
            key = (batch.envelope.gateway_id, batch.envelope.seq)
            assert self.deadlettered.setdefault(key, batch.rows) == batch.rows, key

    @property
    def late(self) -> int:
        return sum(self.late_rows.values())

    @property
    def in_results(self) -> int:
        return sum(int(r["rows"]) for r in self.results)

    @property
    def deadlettered_rows(self) -> int:
        return sum(self.deadlettered.values())


@dataclass
class Run:
    accounting: Accounting
    published: Published
    status: dict[str, Any]
    reports: dict[str, dict[str, Any]]
    clamped: int
    settled_from_ms: int
    """Wall clock when the test began to settle (stop the simulators, then flush)."""


def _simulate(
    local: LocalPipeline, tmp_path: Path, prefix: str, offset_ms: int, load_s: float
) -> None:
    late = (
        ("--late-share", str(LATE_SHARE), "--late-by-ms", str(LATE_BY_MS)) if not offset_ms else ()
    )
    local.start_simulator(
        [
            *("--gateways", "1", "--sensors", "50", "--rate", "20", "--batch", "500"),
            *("--max-delay-ms", str(MAX_DELAY_MS), "--gateway-prefix", prefix, "--stream", STREAM),
            *("--clock-offset-ms", str(offset_ms), "--duration", str(load_s + RUN_ON_S), *late),
            *("--spool", "memory", "--wait-confirmed", "120", "-q"),
            *("--json", str(tmp_path / f"{prefix}.json")),
        ],
        name=f"simulator-{prefix}",
    )


def _status(local: LocalPipeline, spec_path: Path, *, as_json: bool = True) -> Any:
    """``shoal status [--json]`` of the running pipeline, as a user would run it."""
    argv = [sys.executable, "-m", "shoal.cli", "status", "--pipeline", str(spec_path)]
    argv += ["--broker", local.broker.settings.url, "--wait", "2"]
    done = subprocess.run(
        argv + ["--json"] * as_json, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    if not as_json:
        return done.stdout
    status = json.loads(done.stdout)
    assert isinstance(status, dict)
    return status


def _behind_released(status: dict[str, Any]) -> bool:
    return any(g["id"] == "behind-gw000" and g["released"] for g in status["gateways"])


async def _status_once_released(
    local: LocalPipeline, spec_path: Path, until: float
) -> dict[str, Any]:
    """``shoal status --json``, asked again until the gateway behind is released or ``until``.

    The gateway behind is released ``max_hold_ms`` after it began to hold the others back;
    on a loaded machine its simulator starts late, so one look at a fixed time can come first.
    """
    loop = asyncio.get_running_loop()
    status: dict[str, Any] = await asyncio.to_thread(_status, local, spec_path)
    while not _behind_released(status) and loop.time() < until:
        await asyncio.sleep(0.3)
        status = await asyncio.to_thread(_status, local, spec_path)
    print(await asyncio.to_thread(_status, local, spec_path, as_json=False))
    return status


def _clamped(snap: Any) -> int:
    return sum(int(body.get("rows_clamped", 0)) for body in snap.worker_metrics.values())


def _run(tmp_path: Path, *, on_future: str, load_s: float) -> Run:
    spec_path = tmp_path / "skew.toml"
    spec_path.write_text(spec_text(on_future))
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=load_spec(str(spec_path)),
            spec_source=str(spec_path),
            workers=2,
            run_dir=tmp_path / "run",
            per_key_results=False,
        )
    )
    published = Published()
    reports: dict[str, dict[str, Any]] = {}

    async def collect(session: AsyncSession) -> None:
        async for message in session.messages():
            published.take(message, local.topics)

    settled_from_ms: list[int] = []

    async def main() -> tuple[Accounting, dict[str, Any], int]:
        topics = local.topics
        async with (
            local.watching() as session,
            AsyncSession(local.broker.settings, unique_client_id("skew-test")) as reader,
        ):
            outputs = [topics.results("skew"), topics.late("skew"), topics.deadletter("skew")]
            await reader.subscribe([*outputs, topics.ingest(STREAM, ON_TIME_GATEWAY)], qos=1)
            collector = asyncio.create_task(collect(reader))
            assert await local.until(lambda s: len(s.workers) == 2, 60), "no workers"
            for prefix, offset in GATEWAYS.items():
                _simulate(local, tmp_path, prefix, offset, load_s)
            loaded_until = asyncio.get_running_loop().time() + load_s
            await asyncio.sleep(load_s - 5.5)
            status = await _status_once_released(local, spec_path, loaded_until - 0.5)
            settled_from_ms.append(time.time_ns() // 1_000_000)
            accounting = await local.settle(session, timeout_s=60.0)
            reports.update((p, json.loads((tmp_path / f"{p}.json").read_text())) for p in GATEWAYS)
            expect: Callable[[Any], bool] = lambda s: (  # noqa: E731
                on_future != "clamp" or _clamped(s) >= reports["ahead-gw"]["rows_sealed"]
            )
            await local.until(expect, 10.0)  # the workers' next heartbeats
            clamped = _clamped(local.monitor.snapshot())
            await asyncio.sleep(0.5)  # the collector's last messages
            collector.cancel()
            return accounting, status, clamped

    try:
        local.start()
        accounting, status, clamped = asyncio.run(main())
    finally:
        local.stop()
    return Run(accounting, published, status, reports, clamped, settled_from_ms[0])


def _assert_accounted_for(run: Run) -> int:
    """Every sealed measurement is in a result, late, or in a dead-lettered batch; once."""
    published, reports = run.published, run.reports
    assert all(r["rejected"] == 0 for r in reports.values()), reports  # nothing refused at source
    generated = sum(r["rows_sealed"] for r in reports.values())
    assert run.accounting.unconfirmed_batches == 0, run.accounting
    assert run.accounting.generated == generated, run.accounting
    accounted = published.in_results + published.late + published.deadlettered_rows
    print(
        f"generated {generated:,} = in results {published.in_results:,} + late "
        f"{published.late:,} + dead-lettered {published.deadlettered_rows:,} "
        f"(clamped among the applied: {run.clamped:,})"
    )
    assert accounted == generated, (generated, published.in_results, published.late,
                                    published.deadlettered_rows)  # fmt: skip
    # The pipeline's own counters agree with what it published.
    assert run.accounting.in_results == published.in_results, run.accounting
    assert run.accounting.late == published.late, run.accounting
    assert run.accounting.applied == published.in_results + published.late, run.accounting
    # The on-time gateway's deliberately late rows were reported late, and only they: all but
    # those in its first batches (no watermark of its own yet to be late against).
    made_late = reports["ok-gw"]["rows_made_late"]
    on_time_late = published.late_rows.get("ok-gw000", 0)
    print(f"on-time gateway: {made_late} rows stamped {LATE_BY_MS} ms back, {on_time_late} late")
    assert 0.9 * made_late <= on_time_late <= made_late, (on_time_late, made_late)
    return generated


def _on_time_close_delays(run: Run, started_ms: int, *, last_by_flush: bool) -> list[int]:
    """Close delays of the on-time windows that the on-time gateway's event time closed.

    The on-time windows end after the start and before the hour ahead; earlier ones hold
    only the rows ``--late-share`` stamped back before the on-time gateway had a watermark to
    be late against (accepted, not late, and closed late by nature). Of those, the windows
    ending less than ``lateness_ms`` before the on-time gateway's last measurement cannot
    close by the watermark (no later row of it passes them): the flush that settles the run
    closes them, as late after their end as the test is to settle (seconds under load),
    unless another gateway's event time passes them (``last_by_flush`` False: the gateway
    ahead, clamped to the workers' clock, can once the on-time gateway is idle). Every other
    one must close within the bound.
    """
    last_ts = run.published.on_time_last_ts
    assert last_ts is not None, "no batch of the on-time gateway seen"
    on_time = [r for r in run.published.results if started_ms < r["end"] < started_ms + HOUR_MS]
    by_watermark = [r for r in on_time if r["end"] <= last_ts - LATENESS_MS]
    by_flush = [r for r in on_time if r["end"] > last_ts - LATENESS_MS]
    # At most the two windows around the last measurement.
    assert len(by_flush) <= 2, (last_ts, by_flush)
    if last_by_flush:  # and none closed before the test asked for the flush
        assert all(r["emitted_at"] >= run.settled_from_ms for r in by_flush), (
            run.settled_from_ms,
            by_flush,
        )
    assert len(by_watermark) >= 5, run.published.results
    delays = sorted(r["emitted_at"] - r["end"] for r in by_watermark)
    slack = MAX_DELAY_MS + 1_500  # batching, a combiner tick, two checkpoints
    assert delays[-1] <= LATENESS_MS + MAX_HOLD_MS + slack, delays
    flushed = ", ".join(f"{r['emitted_at'] - r['end']}" for r in by_flush) or "none"
    print(
        f"on-time windows: close delay max {delays[-1]} ms, median {delays[len(delays) // 2]} "
        f"({len(delays)} windows); the last (no later row of it): {flushed} ms after their end"
    )
    return delays


def test_gateways_with_clocks_an_hour_off_hold_the_on_time_windows_for_max_hold_at_most(
    tmp_path: Path,
) -> None:
    started_ms = time.time_ns() // 1_000_000
    run = _run(tmp_path, on_future="deadletter", load_s=12.0)
    _on_time_close_delays(run, started_ms, last_by_flush=True)

    # What `shoal status` said near the end: the gateway behind was released (its clock an
    # hour behind); the gateway ahead, all of whose input was refused, holds nothing; the
    # on-time gateway is what the windows wait for.
    status = run.status
    gateways = {g["id"]: g for g in status["gateways"]}
    behind, ahead, on_time = gateways["behind-gw000"], gateways["ahead-gw000"], gateways["ok-gw000"]
    assert behind["released"], behind
    assert not behind["holding"], behind
    assert behind["clock_offset_ms"] > HOUR_MS - 60_000, behind
    assert behind["event_time_behind_ms"] > HOUR_MS - 60_000, behind
    assert ahead["refused_batches"] > 0, ahead
    assert not ahead["holding"], ahead
    assert ahead["watermark"] is None, ahead
    assert on_time["holding"], on_time
    assert not on_time["released"], on_time
    assert all(p["waiting_for"] == ["ok-gw000"] for p in status["partitions"]), status
    assert len(status["workers"]) == 2, status
    assert status["clamped_measurements"] == 0, status

    # Every measurement is accounted for; the gateway ahead's went to the dead letters whole.
    _assert_accounted_for(run)
    ahead_rows = run.reports["ahead-gw"]["rows_sealed"]
    assert ahead_rows > 0
    assert run.published.deadlettered_rows == ahead_rows, run.published.deadlettered
    assert {g for g, _ in run.published.deadlettered} == {"ahead-gw000"}
    assert run.published.reasons == {"ts_in_future"}
    assert run.clamped == 0
    assert run.published.late_rows.get("behind-gw000", 0) > 0, run.published.late_rows


def test_with_on_future_clamp_the_gateway_ahead_is_clamped_and_counted_not_dead_lettered(
    tmp_path: Path,
) -> None:
    started_ms = time.time_ns() // 1_000_000
    run = _run(tmp_path, on_future="clamp", load_s=10.0)
    _on_time_close_delays(run, started_ms, last_by_flush=False)

    # Every row of the gateway an hour ahead lay beyond max_future_ms: each was clamped to a
    # worker's clock (its batches' sent_at is an hour ahead too), counted, and applied.
    ahead_rows = run.reports["ahead-gw"]["rows_sealed"]
    assert ahead_rows > 0
    assert run.clamped == ahead_rows, (run.clamped, ahead_rows)
    assert run.published.deadlettered == {}, run.published.reasons
    generated = _assert_accounted_for(run)
    assert run.published.in_results + run.published.late == generated

    status = run.status
    assert status["clamped_measurements"] > 0, status
    gateways = {g["id"]: g for g in status["gateways"]}
    assert gateways["ahead-gw000"]["refused_batches"] == 0, gateways["ahead-gw000"]
    assert gateways["ahead-gw000"]["watermark"] is not None, gateways["ahead-gw000"]
    assert gateways["behind-gw000"]["released"], gateways["behind-gw000"]
    assert run.published.late_rows.get("ahead-gw000", 0) == 0, run.published.late_rows
