"""The control plane in the secure profile: only an admin may deploy; the broker's refusal
of anyone else is reported by ``shoal pipeline`` (exit 2, ``not_authorized``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from shoal.broker.access import Role
from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.runtime.hosting import CombinerHost, HostConfig
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.control import pool_running, running_plane
from tests.support.datasets import make_batches
from tests.support.live import Collected, collector, publish_batches, until
from tests.support.secure import secure_broker

pytestmark = pytest.mark.broker

ROOT = Topics(root=f"ctl-{uuid.uuid4().hex[:8]}")
PASSWORD = "pw-" + uuid.uuid4().hex[:8]
SPEC = 'name = "temps"\n[[windows]]\nsize_ms = 10000\n'
USERS = {
    "ops": Role.admin(),
    "plane": Role.control(),
    "grafana": Role.dashboard(),
    "worker": Role.worker("temps"),
    "pool": Role.worker(None),
    "pool-combiner": Role.combiner(None),
    "gw0": Role.gateway(),
}


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    with secure_broker(tmp_path_factory.mktemp("secure"), USERS, PASSWORD, ROOT) as broker:
        yield broker


def _cli(broker: EmbeddedBroker, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shoal.cli", "pipeline", *args, "--broker", broker.settings.url]
    argv += ["--topic-root", ROOT.root, "--timeout", "5", "--username", user]
    argv += ["--password", PASSWORD]
    return subprocess.run(argv, input=SPEC, capture_output=True, text=True, timeout=60, check=False)


async def _scenario(broker: EmbeddedBroker, state_dir: Path) -> None:
    settings = broker.settings.with_credentials("plane", PASSWORD)
    async with running_plane(settings, ROOT, SystemClock()) as plane:
        for user in ("grafana", "worker"):
            denied = await asyncio.to_thread(_cli, broker, user, "deploy", "-", "--json")
            assert denied.returncode == 2, denied.stderr
            assert orjson.loads(denied.stdout)["reason"] == "not_authorized"
            (line,) = denied.stderr.splitlines()
            assert line.startswith("shoal pipeline deploy: not_authorized: ")
            assert f"user {user} may not write the control topics" in line
        assert plane.counters.requests == 0  # the broker dropped them
        assert plane.registry.deployed() == []
        # A pool worker (role `worker` without a pipeline) reads the document it was
        # allowed to read and serves it: deploy returns once its heartbeat says so.
        pool = Worker(
            WorkerConfig(None, broker.settings.with_credentials("pool", PASSWORD), ROOT, "pool-s")
        )
        # A pool combiner with the pool role (`combiner` without a pipeline): it reads the
        # documents, joins the pool, owns the partition and publishes results and confirms.
        host = CombinerHost(
            HostConfig(
                broker.settings.with_credentials("pool-combiner", PASSWORD),
                ROOT,
                state_dir,
                "pc0",
                tick_ms=50,
                per_key_results=False,
            )
        )
        batches = make_batches(seed=4, gateways=1, batches_per_gateway=6, late_fraction=0.0)
        admin = broker.settings.with_credentials("ops", PASSWORD)
        async with pool_running(pool, host), collector(admin, ROOT, "temps") as seen:
            accepted = await asyncio.to_thread(_cli, broker, "ops", "deploy", "-", "--json")
            assert accepted.returncode == 0, accepted.stderr
            await publish_batches(
                broker.settings.with_credentials("gw0", PASSWORD),
                ROOT,
                batches,
                list(range(len(batches))),
                encoding=Encoding.MSGPACK_COLUMNAR,
            )
            flushed = await asyncio.to_thread(_cli, broker, "ops", "flush", "temps", "--json")
            assert flushed.returncode == 0, flushed.stderr
            total = sum(b.frame.height for b in batches)
            await until(lambda: _rows(seen) == total, 30, "every row in a result")
        assert orjson.loads(accepted.stdout)["version"] == 1
        assert orjson.loads(accepted.stdout)["confirmed"]["workers"] == ["pool-s"]
        assert orjson.loads(accepted.stdout)["confirmed"]["combiners"]
        assert not seen.deadletters
        listed = await asyncio.to_thread(_cli, broker, "ops", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [p["name"] for p in orjson.loads(listed.stdout)["pipelines"]] == ["temps"]
        assert [d.name for d in plane.registry.deployed()] == ["temps"]
        assert (plane.counters.requests, plane.counters.accepted) == (1, 1)


def _rows(seen: Collected) -> int:
    latest = seen.latest_frame()
    return 0 if latest.is_empty() else int(latest.get_column("rows").sum())


def test_only_an_admin_deploys_and_a_refusal_is_reported(
    secure: EmbeddedBroker, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_scenario(secure, tmp_path), 90))
