"""Bad user functions beside a healthy pipeline, in one real pool worker process.

A control plane (in this process) deploys five pipelines to one pool worker (``shoal
worker`` without ``--pipeline``, a real process) on a real Mosquitto: a healthy one (the
UDF and UDAF examples) and four whose UDF passes the deploy check on sample data but then,
on real batches, raises, spins in a Python loop, blocks in C (``time.sleep``), or returns
garbage (the wrong length). The healthy pipeline's results equal the plain-polars oracle
and close soon after the data ends; every row of every bad pipeline is in its dead letters,
with the reason; the bad pipelines are ``degraded`` in the heartbeats and in ``shoal
pipeline list``; the worker process is the one that started (never restarted).

"On time": the worker acknowledges deliveries in arrival order, so a batch that waits out its
budget holds back the others' acknowledgements; the guard's fail-fast after ``degrade_after``
timeouts bounds that, and the healthy pipeline's windows must close within seconds of the
data's end with no row late (its results equal the oracle's, which counts no row late).

``test_a_hanging_udaf_merge_in_a_combiner``: the same on the combiner's side, a UDAF whose
``merge`` sleeps for an hour on one pool combiner process beside a healthy pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import msgpack
import polars as pl
import pytest
import tomli_w

from shoal._processes import connection_args, shoal_argv
from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding, decode_batch
from shoal.schemas.catalog import json_view
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle
from tests.support.control import running_plane
from tests.support.datasets import make_batches
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.processes import Component, run_shoal
from tests.support.rules_oracle import (
    example_functions,
    expected_with_rules,
    rows_of,
    with_attributes,
)
from tests.unit.schemas.test_output_contract import validator

pytestmark = pytest.mark.broker

COMMON: dict[str, Any] = {
    "lateness_ms": 1_000,
    "idle_timeout_ms": 3_000,  # a loaded 2-core machine: margin against timing-late rows
    "limits": {"max_future_ms": False},
    "windows": [
        {"kind": "tumbling", "size_ms": 2_000},
        {"kind": "hopping", "size_ms": 4_000, "slide_ms": 2_000},
    ],
}
# Deploy-time sample values lie in [1, 2]; the data's (about 20) trigger the fault.
BAD: dict[str, tuple[str, str]] = {
    "raises": (
        "if value.max() > 2.5:\n        raise ValueError('calibration table missing')",
        "function_error",
    ),
    "spins": ("while value.max() > 2.5:\n        pass", "function_timeout"),
    "blocks": ("if value.max() > 2.5:\n        time.sleep(3600)", "function_timeout"),
    "garbage": (
        "if value.max() > 2.5:\n        return pl.concat([value, value])",
        "function_bad_result",
    ),
}


def bad_spec(name: str, body: str) -> dict[str, Any]:
    code = f"import time\n\ndef fix(value):\n    {body}\n    return value\n"
    return {
        "name": name,
        "aggregates": ["count", "mean"],
        "derive": {"value": "fix(value)"},
        "functions": {"fix": {"code": code, "budget_ms": 100}},
        "degrade_after": 3,
        **COMMON,
    }


async def deploy(control: Any, raw: dict[str, Any]) -> None:
    """Deploy ``raw`` (a spec mapping) as version 1 and wait until a pool worker serves it."""
    text = tomli_w.dumps(raw, multiline_strings=True)
    result = await control.request(Request("deploy", raw["name"], spec_toml=text))
    assert result.ok, result.message
    assert await control.served(raw["name"], 1)


def dead_rows(records: list[bytes]) -> tuple[int, set[tuple[str, int]], set[str]]:
    """(rows, (gateway, seq) pairs, reasons) of dead letters (each batch counted once)."""
    rows, seen, reasons = 0, set(), set()
    for raw in records:
        record = msgpack.unpackb(raw, raw=False)
        assert record["error"]["error"] == "FunctionError"
        reasons.add(record["error"]["reason"])
        batch = decode_batch(record["payload"], content_type=record["content_type"])
        identity = (batch.envelope.gateway_id, batch.envelope.seq)
        if identity not in seen:
            seen.add(identity)
            rows += batch.rows
    return rows, seen, reasons


def test_bad_functions_do_not_harm_a_healthy_pipeline_or_the_worker(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    settings = broker.settings
    healthy_raw = {
        "name": "healthy",
        "aggregates": ["count", "mean", "max", "ewm"],
        "checkpoint_interval_ms": 200,
        **example_functions(),
        **COMMON,
    }
    healthy = parse_pipeline(healthy_raw)
    batches = with_attributes(
        make_batches(seed=31, gateways=3, batches_per_gateway=20, rows_per_batch=(1, 80)), seed=3
    )
    worker = Component(
        "pool-worker",
        shoal_argv("worker", "--id", f"{topics.root}-pool", *connection_args(settings, topics)),
        tmp_path / "pool-worker.log",
    )

    async def scenario() -> dict[str, Any]:
        control = ControlClient(settings, topics, timeout_s=15)
        combiners = InProcessPipeline(
            healthy, settings, topics, workers=0, state_dir=tmp_path / "state"
        )
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running_plane(settings, topics, SystemClock()))
            seen = {
                name: await stack.enter_async_context(collector(settings, topics, name))
                for name in ("healthy", *BAD)
            }
            worker.start()
            pid = worker.pid
            await combiners.start()
            specs = [healthy_raw, *(bad_spec(n, body) for n, (body, _) in BAD.items())]
            for raw in specs:
                await deploy(control, raw)
            await publish_batches(
                settings,
                topics,
                batches,
                list(range(len(batches))),
                encoding=Encoding.BINARY_COLUMNAR,
            )
            published_at = time.monotonic()
            threshold = await combiners.finish(batches)
            healthy_done_s = time.monotonic() - published_at
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the bad ones' dead letters, all of them
                if all(dead_rows(seen[n].deadletters)[1] >= _ids(batches) for n in BAD):
                    break
                await asyncio.sleep(0.2)
            health = await control.function_health(2.5)
            listed = await asyncio.to_thread(
                run_shoal,
                "pipeline",
                "list",
                "--json",
                *connection_args(settings, topics),
                timeout=60,
            )
            assert worker.alive()
            assert worker.pid == pid
            assert worker.starts == 1
            worker.stop()
            return {
                "seen": seen,
                "threshold": threshold,
                "healthy_done_s": healthy_done_s,
                "health": health,
                "listed": listed,
            }

    out = asyncio.run(scenario())
    # The figures of docs/benchmarks.md ("Bad functions beside a healthy pipeline"): pytest -s
    print(json.dumps({"healthy_done_s": round(out["healthy_done_s"], 2), "health": out["health"]}))
    seen, threshold = out["seen"], out["threshold"]
    # The healthy pipeline: exact, and on time (its windows closed soon after the data).
    want = expected_with_rules(rows_of(batches), healthy)
    expected = want.published.filter(pl.col("end") <= threshold)
    assert expected.height > 0
    assert_matches_oracle(seen["healthy"].results_frame(), expected, healthy, want.scale)
    assert not seen["healthy"].deadletters
    assert out["healthy_done_s"] < 12, out["healthy_done_s"]  # idle timeout and lateness: 4 s
    # The bad ones: every row in their dead letters, with the reason; degraded.
    total = sum(b.frame.height for b in batches)
    for name, (_, reason) in BAD.items():
        rows, ids, reasons = dead_rows(seen[name].deadletters)
        assert ids == _ids(batches), name
        assert rows == total, name
        assert reason in reasons, (name, reasons)
        assert reasons <= {reason, "function_stuck", "function_degraded"}, (name, reasons)
        assert out["health"][name]["degraded"], name
    # A Python loop is interrupted at each budget until the pipeline is degraded by time, then
    # its batches fail at once; a call blocked in C is not interrupted: the batches behind it
    # fail at once as stuck (and then as degraded).
    assert dead_rows(seen["spins"].deadletters)[2] == {"function_timeout", "function_degraded"}
    assert {"function_timeout", "function_stuck"} <= dead_rows(seen["blocks"].deadletters)[2]
    # Fast failures (raised, garbage) never stop being tried.
    assert dead_rows(seen["raises"].deadletters)[2] == {"function_error"}
    assert not out["health"]["healthy"]["degraded"]
    listed = out["listed"]
    assert listed.returncode == 0, listed.stderr
    flags = {p["name"]: p["degraded"] for p in json.loads(listed.stdout)["pipelines"]}
    assert flags == {"healthy": False, **dict.fromkeys(BAD, True)}


def _ids(batches: list[Any]) -> set[tuple[str, int]]:
    return {(b.gateway_id, b.seq) for b in batches}


# -- a UDAF whose merge hangs, in a pool combiner process beside a healthy pipeline ----------

SLEEPY = """
import time

class Total:
    state = {"s": "float"}
    def init(self):
        return {"s": 0.0}
    def update(self, rows):
        return rows.group_by("group").agg(s=pl.col("value").sum())
    def merge(self, states):
        if states.height > 20:  # the deploy check merges fewer: it passes
            time.sleep(3600)
        return states.group_by("group").agg(s=pl.col("s").sum())
    def finalize(self, states):
        return states["s"]
"""
TUMBLING: dict[str, Any] = {**COMMON, "windows": [{"kind": "tumbling", "size_ms": 2_000}]}


@contextlib.asynccontextmanager
async def heartbeats(settings: Any, topics: Topics) -> Any:
    """The latest combiner heartbeat per pipeline while the body runs."""
    from shoal.broker import default_session_factory  # noqa: PLC0415 - test helper only

    latest: dict[str, dict[str, Any]] = {}

    async def listen() -> None:
        async with default_session_factory()(settings, f"{topics.root}-beats") as session:
            await session.subscribe([topics.metrics("combiner", "+")], qos=0)
            async for message in session.messages():
                body = json.loads(message.payload)
                latest[str(body["pipeline"])] = body

    task = asyncio.create_task(listen())
    try:
        yield latest
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def test_a_hanging_udaf_merge_in_a_combiner(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    """A UDAF whose merge sleeps for an hour (blocked in C: not interruptible), deployed next
    to a healthy pipeline (with a UDAF of its own) on one pool combiner process: the healthy
    results equal the oracle and close on time, the hanging pipeline's windows close too
    with its aggregate null and its count exact, its failures are dead-lettered and it is
    degraded (heartbeats, ``shoal pipeline list``), and the combiner process never restarts."""
    settings = broker.settings
    healthy_raw = {
        "name": "healthy",
        "aggregates": ["count", "mean", "max", "ewm"],
        "checkpoint_interval_ms": 200,
        **example_functions(),
        **COMMON,
    }
    hangs_raw = {
        "name": "hangs",
        "aggregates": ["count", "total"],
        "checkpoint_interval_ms": 200,
        "functions": {
            "total": {"kind": "udaf", "code": SLEEPY, "entry": "Total", "budget_ms": 100}
        },
        "degrade_after": 3,
        **TUMBLING,
    }
    healthy = parse_pipeline(healthy_raw)
    batches = with_attributes(
        make_batches(seed=41, gateways=3, batches_per_gateway=20, rows_per_batch=(1, 80)), seed=4
    )
    root = connection_args(settings, topics)
    worker = Component(
        "pool-worker", shoal_argv("worker", "--id", f"{topics.root}-w", *root), tmp_path / "w.log"
    )
    combiner = Component(
        "pool-combiner",
        shoal_argv(
            "combiner", "--id", f"{topics.root}-c", "--state-dir", str(tmp_path / "s"), *root
        ),
        tmp_path / "c.log",
    )
    end = max(int(b.frame["ts"].max()) for b in batches) - healthy.lateness_ms

    async def scenario() -> dict[str, Any]:
        control = ControlClient(settings, topics, timeout_s=15)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running_plane(settings, topics, SystemClock()))
            seen = {
                name: await stack.enter_async_context(collector(settings, topics, name))
                for name in ("healthy", "hangs")
            }
            beats = await stack.enter_async_context(heartbeats(settings, topics))
            worker.start()
            combiner.start()
            pid = combiner.pid
            for raw in (healthy_raw, hangs_raw):
                await deploy(control, raw)
                assert await control.owned(raw["name"], 1)
            await publish_batches(
                settings,
                topics,
                batches,
                list(range(len(batches))),
                encoding=Encoding.BINARY_COLUMNAR,
            )
            published_at = time.monotonic()
            closed_s: dict[str, float] = {}
            deadline = published_at + 60
            while time.monotonic() < deadline and len(closed_s) < 2:
                for name in ("healthy", "hangs"):
                    mark = beats.get(name, {}).get("closed_through")
                    if name not in closed_s and mark is not None and mark >= end:
                        closed_s[name] = time.monotonic() - published_at
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)  # the last results and dead letters travel
            thresholds = {n: beats[n]["closed_through"] for n in closed_s}
            health = await control.function_health(2.5)
            listed = await asyncio.to_thread(
                run_shoal, "pipeline", "list", "--json", *root, timeout=60
            )
            assert combiner.alive()
            assert combiner.pid == pid
            assert combiner.starts == 1
            combiner.stop()
            worker.stop()
            return {
                "seen": seen,
                "closed_s": closed_s,
                "thresholds": thresholds,
                "health": health,
                "listed": listed,
                "beat": beats["hangs"],
            }

    out = asyncio.run(scenario())
    print(json.dumps({"closed_s": out["closed_s"], "functions": out["beat"].get("functions")}))
    assert set(out["closed_s"]) == {"healthy", "hangs"}, out["closed_s"]
    assert out["closed_s"]["healthy"] < 12, out["closed_s"]
    assert out["closed_s"]["hangs"] < 12, out["closed_s"]
    seen = out["seen"]
    want = expected_with_rules(rows_of(batches), healthy)
    expected = want.published.filter(pl.col("end") <= out["thresholds"]["healthy"])
    assert expected.height > 0
    assert_matches_oracle(seen["healthy"].results_frame(), expected, healthy, want.scale)
    assert not seen["healthy"].deadletters
    # The hanging pipeline: every window closed, its count exact, its aggregate null where a
    # failed merge touched the state; the failures dead-lettered (empty payload) and counted.
    got = seen["hangs"].results_frame().filter(pl.col("end") <= out["thresholds"]["hangs"])
    plain = {k: v for k, v in hangs_raw.items() if k != "functions"}
    counts = expected_with_rules(
        rows_of(batches), parse_pipeline({**plain, "aggregates": ["count"]})
    ).published.filter(pl.col("end") <= out["thresholds"]["hangs"])
    assert got.height == counts.height > 0
    joined = got.join(counts, on=["window", "start", "key"], suffix="_want")
    assert (joined["count"] == joined["count_want"]).all()
    assert got["total"].null_count() > 0
    for raw in seen["hangs"].deadletters:
        validator("deadletter.schema.json").validate(json_view(raw))
    validator("metrics-combiner.schema.json").validate(out["beat"])
    records = [msgpack.unpackb(r, raw=False) for r in seen["hangs"].deadletters]
    reasons = {r["error"]["reason"] for r in records}
    assert "function_timeout" in reasons, reasons
    assert reasons <= {"function_timeout", "function_stuck", "function_degraded"}, reasons
    assert all(r["payload"] == b"" and r["error"]["calls"] >= 1 for r in records)
    functions = out["beat"]["functions"]["hangs"]
    assert functions["failures"]["function_timeout"] >= 1
    assert functions["degraded"]
    assert out["health"]["hangs"]["degraded"]
    assert not out["health"]["healthy"]["degraded"]
    listed = out["listed"]
    assert listed.returncode == 0, listed.stderr
    flags = {p["name"]: p["degraded"] for p in json.loads(listed.stdout)["pipelines"]}
    assert flags == {"healthy": False, "hangs": True}
