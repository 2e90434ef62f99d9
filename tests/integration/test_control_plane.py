"""The control plane on a real Mosquitto: deploy → list/show → update → delete, refusals,
a restart that restores the registry from retained documents, and the ``shoal pipeline`` CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import orjson
import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.clock import FakeClock
from shoal.control.client import ControlClient
from shoal.control.messages import Request
from shoal.control.service import ControlPlane
from shoal.errors import ControlError
from shoal.runtime.hosting import CombinerHost, HostConfig
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.topics import Topics
from tests.support.control import pool_running, running_plane

pytestmark = pytest.mark.broker

SPEC = 'name = "temps"\naggregates = ["count", "mean"]\n[[windows]]\nsize_ms = 10000\n'
CHANGED = SPEC.replace("10000", "5000")


def running(broker: EmbeddedBroker, topics: Topics) -> AbstractAsyncContextManager[ControlPlane]:
    return running_plane(broker.settings, topics, FakeClock(start_ms=1_000))


def _deploy(op: str, text: str) -> Request:
    return Request(op, f"{op}-{len(text)}", spec_toml=text)  # type: ignore[arg-type]


async def _deploy_list_update_delete_and_restore_after_a_restart(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    client = ControlClient(broker.settings, topics, timeout_s=5)
    async with running(broker, topics) as plane:
        first = await client.request(_deploy("deploy", SPEC))
        assert (first.ok, first.version, first.change) == (True, 1, "created")
        clash = await client.request(_deploy("deploy", CHANGED))
        assert (clash.ok, clash.reason, clash.field) == (False, "name_clash", "name")
        bad = await client.request(_deploy("deploy", SPEC.replace('"mean"', '"median!"')))
        assert (bad.ok, bad.reason, bad.field) == (False, "unknown_aggregate", "aggregates")
        updated = await client.request(_deploy("update", CHANGED))
        assert (updated.ok, updated.version, updated.change) == (True, 2, "updated")
        docs = [d for d in await client.documents() if d.deployed]
        assert [(d.name, d.version, d.spec_hash) for d in docs] == [("temps", 2, updated.spec_hash)]
        assert docs[0].spec is not None
        assert docs[0].spec["windows"][0]["size_ms"] == 5_000
        # A control message that is not JSON is answered, and changes nothing.
        reply_to = unique_client_id("raw")
        async with AsyncSession(broker.settings, reply_to) as raw:
            await raw.subscribe([topics.pipeline_reply(reply_to)])
            await raw.publish(topics.pipeline_request(reply_to), b"{not json", qos=1)
            message = await asyncio.wait_for(anext(raw.messages()), 5)
        answer = orjson.loads(message.payload)
        assert (answer["ok"], answer["reason"]) == (False, "invalid_json")
        assert (plane.counters.accepted, plane.counters.refused) == (2, 3)
    # A new control plane restores the registry from the retained documents.
    async with running(broker, topics) as again:
        assert [(d.name, d.version) for d in again.registry.deployed()] == [("temps", 2)]
        assert again.counters.restored == 1
        deleted = await client.request(Request("delete", "d1", name="temps"))
        assert (deleted.ok, deleted.version, deleted.change) == (True, 3, "deleted")
        gone = await client.request(Request("delete", "d2", name="temps"))
        assert (gone.ok, gone.reason) == (False, "unknown_pipeline")
    async with running(broker, topics) as third:
        assert third.registry.deployed() == []
        back = await client.request(_deploy("deploy", SPEC))
        assert (back.ok, back.version) == (True, 4)  # versions never go back


async def _a_client_times_out_clearly_when_no_control_plane_runs(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    client = ControlClient(broker.settings, topics, timeout_s=0.5)
    with pytest.raises(ControlError, match="is `shoal control` running") as timeout:
        await client.request(_deploy("deploy", SPEC))
    assert timeout.value.reason == "timeout"


def _cli(
    broker: EmbeddedBroker, topics: Topics, *args: str, stdin: str = "", timeout: str = "5"
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shoal.cli", "pipeline", *args]
    argv += ["--broker", broker.settings.url, "--topic-root", topics.root, "--timeout", timeout]
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


async def _the_cli_deploys_shows_refuses_and_deletes(
    broker: EmbeddedBroker, topics: Topics, state: Path
) -> None:
    pool = Worker(WorkerConfig(None, broker.settings, topics, worker_id="pool-cli"))
    host = CombinerHost(HostConfig(broker.settings, topics, state, combiner_id="host-cli"))
    async with running(broker, topics), pool_running(pool, host):
        deploy = await asyncio.to_thread(_cli, broker, topics, "deploy", "-", "--json", stdin=SPEC)
        assert deploy.returncode == 0, deploy.stderr
        answer = orjson.loads(deploy.stdout)
        assert answer["version"] == 1
        # It returned once the pool worker served v1 (its heartbeat said so) and the pool
        # combiner owned the pipeline's one partition (its announcement said so).
        assert answer["confirmed"] == {
            "stored": True,
            "workers": ["pool-cli"],
            "combiners": {"0": "host-cli"},
        }
        assert [(o.pipeline, o.partition, o.version) for o in host.owns()] == [("temps", 0, 1)]
        assert pool.routes.describe()["serving"] == {"temps": 1}
        listed = await asyncio.to_thread(_cli, broker, topics, "list", "--json")
        assert [p["name"] for p in orjson.loads(listed.stdout)["pipelines"]] == ["temps"]
        show = await asyncio.to_thread(_cli, broker, topics, "show", "temps", "--json")
        assert orjson.loads(show.stdout)["spec"]["aggregates"] == ["count", "mean"]
        bad = await asyncio.to_thread(
            _cli, broker, topics, "deploy", "-", stdin=SPEC.replace("10000", "0")
        )
        assert bad.returncode == 1
        assert bad.stderr.count("\n") == 1
        assert "invalid_spec (field windows[0].size_ms)" in bad.stderr
        unknown = await asyncio.to_thread(_cli, broker, topics, "delete", "nope")
        assert unknown.returncode == 1
        assert "unknown_pipeline" in unknown.stderr
        deleted = await asyncio.to_thread(_cli, broker, topics, "delete", "temps")
        assert deleted.returncode == 0, deleted.stderr
    async with running(broker, topics):  # no pool worker: stored, but nobody serves it
        unserved = await asyncio.to_thread(
            _cli, broker, topics, "deploy", "-", "--json", stdin=SPEC, timeout="1.5"
        )
        assert unserved.returncode == 2
        assert orjson.loads(unserved.stdout)["reason"] == "not_served"
        assert unserved.stderr.startswith("shoal pipeline deploy: not_served: ")
        stored = await asyncio.to_thread(
            _cli, broker, topics, "update", "-", "--no-wait", stdin=CHANGED
        )
        assert stored.returncode == 0, stored.stderr
        assert "updated to v4" in stored.stdout
    nobody = await asyncio.to_thread(_cli, broker, topics, "delete", "temps")
    assert nobody.returncode == 2
    assert "timeout" in nobody.stderr


def test_deploy_list_update_delete_and_restore_after_a_restart(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    asyncio.run(_deploy_list_update_delete_and_restore_after_a_restart(broker, topics))


def test_a_client_times_out_clearly_when_no_control_plane_runs(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    asyncio.run(_a_client_times_out_clearly_when_no_control_plane_runs(broker, topics))


def test_the_cli_deploys_shows_refuses_and_deletes(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    asyncio.run(_the_cli_deploys_shows_refuses_and_deletes(broker, topics, tmp_path))
