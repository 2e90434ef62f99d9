"""``shoal status --pipeline NAME`` for a pipeline deployed at run time, on a real Mosquitto.

A user who deployed with ``shoal pipeline deploy`` has no file in processors/ for it: status
reads the retained pipeline document, watches the pool's partitions of it, and names the
deployed pipelines when asked for one that does not exist.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.clock import SystemClock
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.control import pool_members, pool_running, running_plane, unconfirmed
from tests.support.datasets import make_batches
from tests.support.live import publish_batches, until

pytestmark = pytest.mark.broker

SPEC = (
    'name = "watched"\naggregates = ["count"]\npartitions = 2\nlateness_ms = 1000\n'
    "limits = { max_future_ms = false }\n[[windows]]\nsize_ms = 2000\n"
)


def _shoal(
    broker: EmbeddedBroker, topics: Topics, *args: str, stdin: str = ""
) -> tuple[int, str, str]:
    argv = [sys.executable, "-m", "shoal.cli", *args]
    argv += ["--broker", broker.settings.url, "--topic-root", topics.root]
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode, done.stdout, done.stderr


async def _scenario(broker: EmbeddedBroker, topics: Topics, tmp: Path) -> None:
    settings = broker.settings
    batches = make_batches(seed=11, gateways=2, batches_per_gateway=4, late_fraction=0.0)
    workers, host = pool_members(settings, topics, tmp / "state")
    async with running_plane(settings, topics, SystemClock()), pool_running(*workers, host):
        code, _, err = await asyncio.to_thread(
            _shoal, broker, topics, "pipeline", "deploy", "-", "--timeout", "10", stdin=SPEC
        )
        assert code == 0, err
        await publish_batches(
            settings, topics, batches, list(range(len(batches))), encoding=Encoding.JSON_ROWS
        )
        await until(lambda: unconfirmed(batches, host, 2) == [], 20, "every batch applied")
        code, out, err = await asyncio.to_thread(
            _shoal, broker, topics, "status", "--pipeline", "watched", "--json", "--wait", "2.5"
        )
        assert code == 0, err
        status = orjson.loads(out)
        assert status["pipeline"] == "watched"
        assert len(status["partitions"]) == 2  # both pool partitions of the deployed spec
        code, _, err = await asyncio.to_thread(
            _shoal, broker, topics, "status", "--pipeline", "nope", "--wait", "0.5"
        )
        assert code == 2
        assert "no pipeline named 'nope'" in err
        assert "deployed: watched" in err


@pytest.mark.timeout(120)
def test_status_watches_a_pipeline_deployed_at_run_time(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_scenario(broker, topics, tmp_path), 100))
