"""A combiner partition's peak RSS when one gateway's batch goes missing for a while.

Run from the repository root (docs/benchmarks.md, "The combiner's allowances")::

    python docs/bench/combiner_gap_memory.py [--rate 750] [--seconds 20] [--gap-at 6]
        [--gap 5] [--pending-mib 8]

In one process, no broker: the pipeline of ``shoal bench chaos`` (two window specs, every
aggregate), two gateways of 500 sensors at ``--rate`` measurements/s per sensor in
4,000-row binary batches, built into partials as a worker builds them and applied to
partition 0's combiner core with its reorder buffer's files (``runtime._spill``), the
clock following event time and a tick every 100 ms. One batch of the second gateway is
held back at ``--gap-at`` seconds and delivered ``--gap`` seconds later (a killed worker's
batch, sent again): meanwhile that gateway's later partials wait in the reorder buffer,
``--pending-mib`` of them in memory, the rest in files. ``--gap 0``: no batch is held back.
Prints one JSON line: RSS at the start, peak RSS (``VmHWM``), the most state cells held.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from shoal.clock import FakeClock
from shoal.loadtest.chaos import CHAOS_PIPELINE
from shoal.loadtest.data import SensorField
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.runtime._spill import DirectorySpill
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

T0 = 1_700_000_000_000
ROWS = 4_000
SENSORS = 500
TICK_MS = 100


def _mb(key: str) -> float:
    with Path("/proc/self/status").open() as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    """Run and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=750.0, help="per sensor per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="event time to run")
    parser.add_argument("--gap-at", type=float, default=6.0, help="when a batch goes missing")
    parser.add_argument("--gap", type=float, default=5.0, help="how long it stays missing")
    parser.add_argument("--pending-mib", type=float, default=8.0, help="reorder buffer memory")
    args = parser.parse_args()
    spec = parse_pipeline(tomllib.loads(CHAOS_PIPELINE))
    encoding = Encoding.parse("binary")
    clock = FakeClock(T0)
    with tempfile.TemporaryDirectory() as folder:
        core = Combiner(
            spec,
            0,
            clock,
            logged=False,
            max_pending_bytes=int(args.pending_mib * 2**20),
            spill=lambda: DirectorySpill(Partial.encode, Partial.decode, parent=Path(folder)),
        )
        builder = PartialBuilder(spec, "w")
        fields = [SensorField(f"g{g}", SENSORS, args.rate, T0, attributes=False) for g in (0, 1)]
        for g in (0, 1):
            core.receive_status(
                GatewayStatus(f"g{g}", "chaos", 1 << 40, 0, 1 << 40, 0, None, 0, 0, 0)
            )
        period_ms = ROWS / (SENSORS * args.rate) * 1000
        gap_at, gap_ms = args.gap_at * 1000, args.gap * 1000
        start_mb, cells, seqs = _mb("VmRSS"), 0, [0, 0]
        held: list[bytes] = []
        t, last_tick, wall = 0.0, 0.0, time.monotonic()
        while t < args.seconds * 1000:
            t += period_ms
            now = T0 + int(t)
            for g in (0, 1):
                block = fields[g].take(now)
                payload = encode_batch(
                    block, gateway_id=f"g{g}", seq=seqs[g], sent_at_ms=now, encoding=encoding
                )
                batch = decode_batch(
                    payload, content_type=encoding.content_type, limits=spec.limits, now_ms=now
                )
                info = BatchInfo(f"g{g}", seqs[g], "chaos", batch.rows, None, None, now, now, "w")
                seqs[g] += 1
                partial = next(
                    p for p in builder.build_batch(batch, info, now) if p.partition == 0
                ).encode()
                if g == 1 and gap_ms > 0 and gap_at <= t < gap_at + period_ms:
                    held.append(partial)
                else:
                    core.receive(Partial.decode(partial))
            if held and t >= gap_at + gap_ms:
                core.receive(Partial.decode(held.pop()))
            clock.advance(now - clock.now_ms())
            if t - last_tick >= TICK_MS:
                core.tick()
                last_tick = t
            cells = max(cells, core.state_cells)
    record = {
        "rate_per_sensor": args.rate,
        "meas_per_s": args.rate * SENSORS * 2,
        "event_seconds": args.seconds,
        "gap_s": args.gap,
        "pending_mib": args.pending_mib,
        "start_rss_mb": round(start_mb, 1),
        "peak_rss_mb": round(_mb("VmHWM"), 1),
        "max_state_cells": cells,
        "wall_s": round(time.monotonic() - wall, 1),
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
