"""``shoal scaler --pool`` on a real broker: the worker pool is scaled on the sum of the lags.

Real Mosquitto and control plane; two pipelines deployed at run time (and an alias of one,
which computes nothing), a gateway whose batches nobody has confirmed yet, and the scaler
as ``shoal scaler --pool`` runs it (``ScalerConfig(spec=None)``, its own broker session,
real ``shoal worker`` pool processes started and drained by ``LocalBackend``). Each
pipeline's lag alone asks for one worker, their sum for two: the scaler starts two.
Deleting one pipeline halves the sum, and the scaler drains one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from shoal._processes import ChildProcess, connection_args, shoal_argv
from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.clock import SystemClock
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.runtime.scaler import PoolMonitor, Scaler, ScalerConfig
from shoal.scaler.backends import LocalBackend
from shoal.scaler.policy import Bounds, LagConfig, LagPolicy, lag_recommendation
from shoal.scaler.signals import signals_from
from shoal.schemas.control import GatewayStatus
from shoal.schemas.topics import Topics
from tests.support.control import running_plane
from tests.support.live import until

pytestmark = pytest.mark.broker

UNCONFIRMED_ROWS = 6_000
"""The gateway's backlog: every deployed computation has it to do."""
POLICY = LagConfig(
    bounds=Bounds(0, 4),
    # Planned at 0.7 x 2,400 = 1,680 measurements/s per worker, a backlog drained within 5 s:
    # one pipeline's 6,000 need 1,200/s (one worker), two pipelines' 12,000 need 2,400/s (two).
    default_capacity_rows_per_s=2_400.0,
    up_window_s=0.5,
    down_window_s=3.0,
    cooldown_s=1.0,
)


def spec(name: str, size_ms: int) -> str:
    return f'name = "{name}"\naggregates = ["count"]\n[[windows]]\nsize_ms = {size_ms}\n'


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


async def _deploy(client: ControlClient, request: Request) -> None:
    result = await client.request(request)
    assert result.ok, result.message


async def _scenario(broker: EmbeddedBroker, topics: Topics, logs: Path) -> None:
    settings = broker.settings
    counter = itertools.count()

    def spawn() -> ChildProcess:  # as `shoal scaler --pool` starts its local workers
        index = next(counter)
        child = ChildProcess(
            f"worker-{index}",
            shoal_argv("worker", *connection_args(settings, topics)),
            logs / f"worker-{index}.log",
            {"POLARS_MAX_THREADS": "1"},
        )
        child.start()
        return child

    backend = LocalBackend(spawn, drain_timeout_s=30)
    scaler = Scaler(
        ScalerConfig(None, settings, topics, bounds=POLICY.bounds, http_port=0, interval_s=0.25),
        backend,
    )
    scaler.policy = LagPolicy(POLICY)
    monitor = scaler.monitor
    assert isinstance(monitor, PoolMonitor)
    async with running_plane(settings, topics, SystemClock()):
        client = ControlClient(settings, topics)
        await _deploy(client, Request("deploy", uuid.uuid4().hex, spec_toml=spec("a", 10_000)))
        await _deploy(client, Request("deploy", uuid.uuid4().hex, spec_toml=spec("b", 5_000)))
        # The same computation as a under another name: an alias, no work of its own.
        await _deploy(client, Request("deploy", uuid.uuid4().hex, spec_toml=spec("a2", 10_000)))
        async with AsyncSession(settings, unique_client_id("gw")) as gateway:
            status = GatewayStatus(
                "gw",
                "s",
                20,
                0,
                20,
                UNCONFIRMED_ROWS,
                int(time.time() * 1000) - 5_000,
                0,
                UNCONFIRMED_ROWS,
                int(time.time() * 1000),
            )
            await gateway.publish(topics.gateway_status("gw"), status.to_json(), retain=True)
        task = asyncio.create_task(scaler.run())
        try:
            # (The scaler's thread calls the backend; the test only reads it.)
            await until(lambda: len(backend.live) == 2, 30, "two workers started")
            assert sorted(monitor.monitors) == ["a", "b"]
            both = monitor.snapshot()
            assert both.lag_rows == 2 * UNCONFIRMED_ROWS
            up = next(r for r in scaler.history if r.decision.desired == 2)
            assert up.signals.backlog_rows == 2 * UNCONFIRMED_ROWS
            assert up.decision.reason == "demand needs 2 workers"
            # Either pipeline alone would have asked for one: the sum made it two.
            for name in ("a", "b"):
                alone = signals_from(monitor.monitors[name].snapshot(), 0.0, 0)
                assert alone.backlog_rows == UNCONFIRMED_ROWS
                assert lag_recommendation(alone, POLICY) == 1
            body = await asyncio.to_thread(
                _get, f"http://127.0.0.1:{scaler.bound_port}/api/v1/scaling"
            )
            assert (body["pipeline"], body["desired_workers"]) == ("*", 2)
            assert body["lag_measurements"] == 2 * UNCONFIRMED_ROWS
            # Deleting b leaves a's lag: the sum halves and one worker is drained.
            deleted_at = len(scaler.history)
            await _deploy(client, Request("delete", uuid.uuid4().hex, name="b"))
            await until(lambda: len(backend.live) == 1, 60, "one worker drained")
            down = next(r for r in scaler.history[deleted_at:] if r.decision.desired == 1)
            assert down.signals.backlog_rows == UNCONFIRMED_ROWS
            assert sorted(monitor.monitors) == ["a"]
            await until(lambda: backend.stats.drained == 1, 30, "the drained worker exited")
        finally:
            scaler.stop()
            await asyncio.wait_for(task, 30)
    assert backend.stats.crashed == 0
    assert backend.stats.started == 2


@pytest.mark.timeout(180)
def test_the_pool_scaler_follows_the_sum_of_the_lags(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 170))
