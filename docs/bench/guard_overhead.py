"""CPU and wall time the function guard adds per batch (docs/benchmarks.md, docs/rules.md).

Run from the repository root::

    python docs/bench/guard_overhead.py

``FunctionGuard.run`` of a no-op (a thread per call, the event loop waiting for it) against
awaiting the same no-op directly, 2,000 calls each after a warm-up. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from shoal.rules.guard import FunctionGuard

CALLS = 2_000


async def _direct() -> None:
    return None


def main() -> None:
    """Time both and print the record."""
    guard = FunctionGuard(1.0, 3, time.monotonic)
    loop = asyncio.new_event_loop()
    for _ in range(100):
        loop.run_until_complete(guard.run(lambda: None))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(CALLS):
        loop.run_until_complete(guard.run(lambda: None))
    guarded = ((time.process_time() - cpu) / CALLS, (time.perf_counter() - wall) / CALLS)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(CALLS):
        loop.run_until_complete(_direct())
    bare = ((time.process_time() - cpu) / CALLS, (time.perf_counter() - wall) / CALLS)
    loop.close()
    record = {
        "calls": CALLS,
        "guard_cpu_us": round(guarded[0] * 1e6, 1),
        "guard_wall_us": round(guarded[1] * 1e6, 1),
        "bare_cpu_us": round(bare[0] * 1e6, 1),
        "bare_wall_us": round(bare[1] * 1e6, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
