"""``LocalPipeline`` on the secure profile: each component logs in with its own role, and
credentials reach child processes by environment, never on their command lines."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from shoal._cli.common import load_spec
from shoal.runtime.local import LocalPipeline, LocalPipelineConfig

pytestmark = pytest.mark.broker


@pytest.mark.timeout(120)
def test_secure_local_pipeline_is_exact_with_roles(tmp_path) -> None:
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=load_spec("default"),
            spec_source="default",
            workers=2,
            profile="secure",
            run_dir=tmp_path,
            per_key_results=False,
            gateway_ids=("sim-gw000",),
        )
    )

    async def run() -> tuple[object, list[str]]:
        async with local.watching() as session:
            local.start_simulator(
                [
                    "--gateways", "1", "--sensors", "50", "--rate", "20", "--batch", "500",
                    "--duration", "3", "--spool", "memory", "--quiet",
                ]
            )  # fmt: skip
            assert await local.until(lambda s: s.rows_generated > 0, 30)
            command_lines = [
                " ".join(psutil.Process(c.pid).cmdline())
                for c in (*local.children, *local.workers, *local.simulators)
                if c.pid is not None and c.alive()
            ]
            accounting = await local.settle(session, timeout_s=60)
        return accounting, command_lines

    try:
        local.start()
        accounting, command_lines = asyncio.run(asyncio.wait_for(run(), 100))
    finally:
        local.stop()
    assert accounting.generated > 0  # type: ignore[attr-defined]
    assert accounting.exact, accounting  # type: ignore[attr-defined]
    secrets = [user.password for user in local.users.values()]
    assert {"combiner", "worker", "admin", "simulator", "dashboard"} <= set(local.users)
    assert len(command_lines) == 4  # combiner, two workers, the simulator
    for line in command_lines:
        assert not any(secret in line for secret in secrets), line
    assert "allow_anonymous false" in local.broker.config_path.read_text()
