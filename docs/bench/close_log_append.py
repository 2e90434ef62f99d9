"""The close log's durable append: written and flushed to disk, as a close waits for it.

Run from the repository root (docs/benchmarks.md, "Worker and close path at scenarios A and
B: first/last by index, the close log's flush measured, the array rendered ahead")::

    python docs/bench/close_log_append.py [APPENDS]

One partition's log in a temporary folder under the working directory (the disk the
combiners' state is on): a close decided at a vector of 10 gateways, ``CloseLog.take``, handed
to a ``LogWriter`` and awaited (the entry is in the file and, as it publishes a window, on
disk), APPENDS times (default 1,000). Prints p50/p99/mean in microseconds. Run another
checkout with ``PYTHONPATH=<checkout>/src`` to compare, alternating.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from shoal.processors.close_log import CloseLog, Decision
from shoal.runtime._log_writer import LogWriter

GATEWAYS = 10


async def _appends(folder: Path, count: int) -> list[int]:
    path = folder / "combiner.closes"
    log, writer = CloseLog(), LogWriter()
    spent = []
    try:
        for k in range(count + 1):
            log.record(Decision("close", k * 10_000, {f"gw-{g}": k for g in range(GATEWAYS)}))
            write = log.take()
            assert write is not None
            started = time.perf_counter_ns()
            await writer.submit(path, write)
            if k:  # the first write creates the file (a rewrite): not an append
                spent.append(time.perf_counter_ns() - started)
    finally:
        writer.close()
    return spent


def main() -> None:
    """Time the appends and print one JSON line."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:
        spent = sorted(asyncio.run(_appends(Path(folder), count)))
    record = {
        "appends": count,
        "p50_us": round(spent[len(spent) // 2] / 1e3),
        "p99_us": round(spent[int(len(spent) * 0.99)] / 1e3),
        "mean_us": round(sum(spent) / len(spent) / 1e3),
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
