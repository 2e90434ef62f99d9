"""Overload degrades, never stalls (issue 21): a burst into one fixed worker drains completely.

The worker is paused (SIGSTOP) while its gateway keeps publishing: overload with no capacity
at all, and the same on any machine whatever its speed. The broker's queue for the worker is
set well below the backlog that builds, as a burst at the edge (a gateway flushing its spool
after an outage) does to any queue. Before the fix the gateway kept publishing as fast as the
broker acknowledged, the broker dropped what did not fit, and the combiner then waited for
re-sends that came minutes later: the backlog did not drain. Now the gateway keeps at most
its end-to-end window unconfirmed (the rest waits in its spool) and a combiner names the
seqs it misses so they are re-sent at once.

Two cases:

* a queue larger than the window: the window alone keeps the broker from dropping anything,
  so nothing is re-sent. Not timed, and yet the old behaviour cannot pass: the gateways'
  stall timer (the only way the old pipeline recovered a dropped batch) is set far beyond
  the time settling waits without progress, so a pipeline that needs it ends the run with
  batches unconfirmed (and re-sends);
* a queue smaller than the window, with the gateways' default timers: the broker drops
  batches all through the burst, and gap reports (plus the stall timer for the last ones,
  which no later batch reveals) repair them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from shoal._cli.common import load_spec
from shoal.runtime.local import Accounting, LocalPipeline, LocalPipelineConfig

pytestmark = pytest.mark.broker

PAUSE_S = 8.0
# One gateway x 1,000 sensors x 1,000/s: 1 M measurements/s in batches of 16,000 (~200 kB).
LOAD = ["--gateways", "1", "--sensors", "1000", "--rate", "1000", "--batch", "16000"]
STALL_TIMER_MS = 180_000
WINDOW_BYTES = 16 * 2**20  # GatewayConfig.max_unconfirmed_bytes
SETTLE_WITHOUT_PROGRESS_S = 60.0
BYTES_PER_ROW = 12  # binary columnar, about 12.5 on the wire


def _run(
    tmp_path: Path, queue_bytes: int, gateway_args: list[str]
) -> tuple[Accounting, int, dict[str, object]]:
    local = LocalPipeline(
        LocalPipelineConfig(
            spec=load_spec("baseline-equivalent"),
            spec_source="baseline-equivalent",
            workers=1,
            run_dir=tmp_path,
            per_key_results=False,
            broker_overrides=(("max_queued_bytes", str(queue_bytes)),),
        )
    )
    report = tmp_path / "simulator.json"

    async def main() -> tuple[Accounting, int]:
        async with local.watching() as session:
            assert await local.until(lambda s: len(s.workers) == 1, 60), "no worker"
            local.start_simulator(
                [
                    *LOAD,
                    *("--duration", "3600", "--spool", "memory", "--json", str(report)),
                    *gateway_args,
                    *("--wait-confirmed", "600", "-q"),
                ]
            )
            assert await local.until(lambda s: s.batch_rows_applied > 0, 60), "no progress"
            worker = local.pause("worker-0")
            await asyncio.sleep(PAUSE_S)
            backlog = local.monitor.snapshot().lag_rows
            local.resume(worker)
            await asyncio.sleep(2.0)  # the load goes on after the burst
            return await local.settle(session, timeout_s=SETTLE_WITHOUT_PROGRESS_S), backlog

    try:
        local.start()
        accounting, backlog = asyncio.run(main())
    finally:
        local.stop()
    # A simulator aborted by settling (it never saw everything confirmed) writes no report.
    simulator = json.loads(report.read_text()) if report.exists() else {}
    assert isinstance(simulator, dict)
    return accounting, backlog, simulator


@pytest.mark.parametrize(
    "queue_mib", [48, 4], ids=["window-smaller-than-the-queue", "queue-smaller-than-the-window"]
)
@pytest.mark.broker_quirk(
    "mosquitto",
    reason="bounds the worker's queue with Mosquitto's max_queued_bytes; Mochi bounds "
    "queues by count only (docs/brokers.md, difference 12)",
    run=False,
)
def test_a_burst_into_one_worker_drains_with_every_batch_confirmed(
    tmp_path: Path, queue_mib: int
) -> None:
    queue_bytes = queue_mib * 2**20
    window_fits = queue_bytes > WINDOW_BYTES
    stall = ["--resend-after-ms", str(STALL_TIMER_MS)] if window_fits else []
    accounting, backlog, simulator = _run(tmp_path, queue_bytes, stall)
    # The burst was larger than the broker's queue for the worker could ever hold.
    assert backlog * BYTES_PER_ROW > 1.5 * queue_bytes, backlog
    assert accounting.unconfirmed_batches == 0, accounting
    assert accounting.drain_s is not None, accounting
    assert accounting.generated == accounting.applied, accounting
    assert accounting.lost == 0, accounting
    assert accounting.duplicated == 0, accounting
    assert simulator.get("confirmed") is True, simulator
    if window_fits:  # the broker dropped nothing
        assert simulator["resends"] == 0, simulator
