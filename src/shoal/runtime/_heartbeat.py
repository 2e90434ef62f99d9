"""A heartbeat's payload: the metrics as JSON, in a buffer of its own size.

orjson returns its output in the buffer it grew while writing: a 2 KB heartbeat occupies about
8 KB (measured alone: 8.0 KB of RSS per retained 1.9 KB payload, 1.9 KB for a copy). A pool
combiner sends one heartbeat per hosted partition every second; a tracemalloc snapshot of one
hosting 1,000 partitions found 2,000 such ~8 KB blocks live, allocated where it dumps them
(docs/benchmarks.md, "Many pipelines on the pools"). What the copy saves end to end is within
the run-to-run spread of that benchmark's RSS (+-10 MB) and is not claimed.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson


def heartbeat_payload(metrics: Mapping[str, object]) -> bytes:
    """``metrics`` as compact JSON bytes, copied out of orjson's over-sized buffer."""
    return bytes(memoryview(orjson.dumps(metrics)))
