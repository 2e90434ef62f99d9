"""What a subprocess per function would cost per batch, for comparison with the guard.

Run from the repository root::

    python docs/bench/subprocess_cost.py

A persistent child process receives one 16,000-row batch's argument column (float64, raw
bytes over a pipe), applies the UDF example's calibration curve, and sends the result back;
the parent waits. Reported: wall time per round trip and CPU of both processes per batch,
against calling the same function in-process through ``FunctionGuard``. Serialising the
columns is the cheapest form (one column, no strings); a UDF on string columns or a UDAF's
state would cost more. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

import numpy as np
import psutil

from shoal.rules.guard import FunctionGuard

ROWS = 16_000
CALLS = 500
CURVE = [2.0e-5, -1.5e-3, 1.02, -0.4]


def _child(conn: Connection) -> None:
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        values = np.frombuffer(data, dtype="<f8")
        conn.send_bytes(np.polyval(CURVE, values).astype("<f8").tobytes())


def main() -> None:
    """Time both and print the record."""
    values = np.random.default_rng(1).normal(20, 8, ROWS)
    parent, child_end = mp.Pipe()
    child = mp.get_context("spawn").Process(target=_child, args=(child_end,), daemon=True)
    child.start()
    proc = psutil.Process(child.pid)
    for _ in range(50):
        parent.send_bytes(values.tobytes())
        parent.recv_bytes()
    child_cpu0 = sum(proc.cpu_times()[:2])
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(CALLS):
        parent.send_bytes(values.tobytes())
        out = np.frombuffer(parent.recv_bytes(), dtype="<f8")
    sub_wall = (time.perf_counter() - wall) / CALLS
    sub_cpu = (time.process_time() - cpu) / CALLS
    child_cpu = (sum(proc.cpu_times()[:2]) - child_cpu0) / CALLS
    assert len(out) == ROWS
    parent.send_bytes(b"")
    child.join(5)

    guard = FunctionGuard(1.0, 3, time.monotonic)
    loop = asyncio.new_event_loop()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(CALLS):
        loop.run_until_complete(guard.run(lambda: np.polyval(CURVE, values)))
    in_wall = (time.perf_counter() - wall) / CALLS
    in_cpu = (time.process_time() - cpu) / CALLS
    loop.close()
    record = {
        "rows": ROWS,
        "calls": CALLS,
        "subprocess_wall_us": round(sub_wall * 1e6, 1),
        "subprocess_cpu_us_parent": round(sub_cpu * 1e6, 1),
        "subprocess_cpu_us_child": round(child_cpu * 1e6, 1),
        "in_process_guard_wall_us": round(in_wall * 1e6, 1),
        "in_process_guard_cpu_us": round(in_cpu * 1e6, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
