"""CPU of ticking idle hosted partitions: a ticker task each vs one timer per pool member.

Run from the repository root (docs/benchmarks.md, "Close-log appends off the loop; one ticker
per member")::

    python docs/bench/pool_ticks.py PARTITIONS SECONDS tasks|one

PARTITIONS combiner partitions of small pipelines (no broker: nothing to publish while
idle) are ticked every 100 ms for SECONDS, either each by a task of its own (before) or all
by one loop that gives the event loop back every 50 (``CombinerHost._ticks``). Prints the
process's CPU as a percentage of one core.
"""

from __future__ import annotations

import asyncio
import sys
import time

from shoal.broker.settings import BrokerSettings
from shoal.processors.spec import parse_pipeline
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.runtime.hosting import TICKS_PER_TURN

TICK_S = 0.1


async def _each(runtime: CombinerRuntime) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        runtime._tick(None)  # type: ignore[arg-type]  # idle: publishes nothing


async def _one(runtimes: list[CombinerRuntime]) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        for done, runtime in enumerate(runtimes, 1):
            runtime._tick(None)  # type: ignore[arg-type]
            if done % TICKS_PER_TURN == 0:
                await asyncio.sleep(0)


async def _measure(runtimes: list[CombinerRuntime], seconds: float, mode: str) -> float:
    loops = [_each(r) for r in runtimes] if mode == "tasks" else [_one(runtimes)]
    tasks = [asyncio.create_task(loop) for loop in loops]
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for task in tasks:
        task.cancel()
    return 100.0 * cpu / wall


def main() -> None:
    """Build the partitions, tick them, print the CPU share."""
    count, seconds, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    runtimes = []
    for i in range(count):
        spec = parse_pipeline(
            {
                "name": f"p{i}",
                "aggregates": ["count", "mean"],
                "windows": [{"kind": "tumbling", "size_ms": 10_000}],
            }
        )
        runtimes.append(CombinerRuntime(CombinerConfig(spec, 0, BrokerSettings())))
    share = asyncio.run(_measure(runtimes, seconds, mode))
    sys.stdout.write(
        f"{mode}, {count} partitions: {share:.1f} % of a core over {seconds:g} s" + "\n"
    )


if __name__ == "__main__":
    main()
