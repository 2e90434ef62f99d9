"""The control plane in the secure profile: only an admin may deploy; the broker's refusal
of anyone else is reported by ``shoal pipeline`` (exit 2, ``not_authorized``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator

import orjson
import pytest

from shoal.broker.access import Role
from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.topics import Topics
from tests.support.control import pool_running, running_plane
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


async def _scenario(broker: EmbeddedBroker) -> None:
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
        async with pool_running(pool):
            # combiners stay pinned in the secure profile (no ACL for pool combiners yet)
            accepted = await asyncio.to_thread(
                _cli, broker, "ops", "deploy", "-", "--json", "--no-combiners"
            )
        assert accepted.returncode == 0, accepted.stderr
        assert orjson.loads(accepted.stdout)["version"] == 1
        assert orjson.loads(accepted.stdout)["confirmed"]["workers"] == ["pool-s"]
        listed = await asyncio.to_thread(_cli, broker, "ops", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [p["name"] for p in orjson.loads(listed.stdout)["pipelines"]] == ["temps"]
        assert [d.name for d in plane.registry.deployed()] == ["temps"]
        assert (plane.counters.requests, plane.counters.accepted) == (1, 1)


def test_only_an_admin_deploys_and_a_refusal_is_reported(secure: EmbeddedBroker) -> None:
    asyncio.run(asyncio.wait_for(_scenario(secure), 90))
