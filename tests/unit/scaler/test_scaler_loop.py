"""The scaler's decision loop survives a failing backend (no broker: the loop alone)."""

from __future__ import annotations

import asyncio

from shoal.broker.settings import BrokerSettings
from shoal.errors import ShoalError
from shoal.processors.spec import parse_pipeline
from shoal.runtime.scaler import Scaler, ScalerConfig
from shoal.scaler.policy import Bounds

SPEC = parse_pipeline({"name": "p", "windows": [{"kind": "tumbling", "size_ms": 1000}]})


class FlakyBackend:
    """Fails its first ``failures`` calls to observe, then works."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.workers = 1
        self.scaled: list[int] = []

    def observe(self) -> int:
        if self.failures:
            self.failures -= 1
            raise ShoalError("the Kubernetes API said 503")
        return self.workers

    def scale_to(self, desired: int) -> None:
        self.scaled.append(desired)
        self.workers = desired

    def close(self) -> None:
        pass


def test_a_failing_backend_does_not_stop_the_decision_loop() -> None:
    backend = FlakyBackend(failures=3)
    scaler = Scaler(
        ScalerConfig(SPEC, BrokerSettings(), bounds=Bounds(2, 4), interval_s=0.01, http_port=None),
        backend,
    )

    async def main() -> None:
        task = asyncio.create_task(scaler._ticks())
        for _ in range(500):
            if backend.scaled:
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert scaler.tick_errors == 3
    assert backend.scaled[0] == 2  # the first decision once the backend answered: the minimum
    assert scaler.history[-1].decision.desired == 2
