"""Traced memory of one combiner partition's window state, in process (no broker, no output).

``.venv/bin/python docs/bench/combiner_state_memory.py KIND KEYS SECONDS`` (KIND: tumbling,
sliding or hopping, 10 s windows, sliding/hopping with a 1 s step; scenario B's aggregates)
feeds KEYS keys at 10 rows/s each for SECONDS of event time, one batch of every key each
100 ms, through ``PartialBuilder`` and ``Combiner`` with a tick after each batch, and prints
tracemalloc's figures (numpy and Python allocations; polars' own allocator is not traced):
what is held at the end, the most held between batches, and the peak (inside a close).
Figures: docs/benchmarks.md, "Sliding windows: where the combiner's memory goes".
"""

from __future__ import annotations

import sys
import time
import tracemalloc

import numpy as np
import polars as pl

from shoal.clock import FakeClock
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.schemas import FRAME_SCHEMA
from shoal.schemas.control import GatewayStatus

WINDOWS = {
    "tumbling": {"kind": "tumbling", "size_ms": 10_000},
    "sliding": {"kind": "sliding", "size_ms": 10_000, "step_ms": 1_000},
    "hopping": {"kind": "hopping", "size_ms": 10_000, "slide_ms": 1_000},
}
AGGREGATES = ["count", "mean", "min", "max", "stddev", "first", "last", "p50", "p95", "p99"]


def main(kind: str, keys: int, seconds: int) -> None:
    """Feed one partition and write its traced memory figures to stdout."""
    spec = parse_pipeline(
        {
            "name": "c",
            "key": "sensor_id",
            "windows": [{"name": "w", **WINDOWS[kind]}],
            "aggregates": AGGREGATES,
            "lateness_ms": 2_000,
            "idle_timeout_ms": 10_000,
        }
    )
    clock = FakeClock(0)
    builder = PartialBuilder(spec, "w1")
    core = Combiner(spec, 0, clock)
    core.receive_status(GatewayStatus("gw", "s", 10**6, 0, 10**6, 0, None, 0, 0, 0))
    ids = pl.Series([f"s{i:06d}" for i in range(keys)])
    rng = np.random.default_rng(1)
    tracemalloc.start()
    began, between = time.perf_counter(), 0
    for seq in range(seconds * 10):
        frame = pl.DataFrame(
            {
                "sensor_id": ids,
                "ts": np.full(keys, 1_000_000 + seq * 100, np.int64),
                "value": 20 + rng.normal(0, 2, keys),
                "name": None,
                "type": None,
                "unit": None,
            },
            schema=FRAME_SCHEMA,
        )
        clock.advance(100)
        batch = BatchInfo("gw", seq, "s", 0, None, None, 0, 0, "w1")
        core.receive(builder.build(frame, batch, clock.now_ms())[0])
        core.tick()
        between = max(between, tracemalloc.get_traced_memory()[0])
    now, peak = tracemalloc.get_traced_memory()
    sys.stdout.write(
        f"{kind} keys={keys}: traced now {now / 1e6:.1f} MB, most between batches "
        f"{between / 1e6:.1f} MB, peak {peak / 1e6:.1f} MB, state cells {core.state_cells}, "
        f"{time.perf_counter() - began:.1f} s\n"
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
