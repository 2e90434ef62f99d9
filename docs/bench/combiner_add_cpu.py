"""A combiner's CPU per partial taken in (``WindowState.add``), at scenario B, in one process.

Run from the repository root (docs/benchmarks.md, "The combiner takes a partial as it
comes")::

    python docs/bench/combiner_add_cpu.py [ROUNDS]

200 partials of the default pipeline, built the way workers build them (10 gateways of
1,000 sensors at 600/s, 16,000-row binary batches: each partial 1,000 state rows and about
4,700 sketch cells), encoded and decoded as they travel, go into a fresh ``WindowState``
per round, merged between messages as the runtime does (``tidy``). Prints the best round's
mean time of ``add`` per partial, in microseconds, as one JSON line. Run another checkout
with ``PYTHONPATH=<checkout>/src`` to compare, alternating.
"""

from __future__ import annotations

import json
import sys
import time

from shoal._cli.common import spec_path
from shoal.loadtest.data import SensorField
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import load_pipeline
from shoal.processors.state import WindowState
from shoal.schemas import Encoding, decode_batch, encode_batch

START_MS = 1_700_000_000_000
ROWS = 16_000


def _partials() -> list[Partial]:
    spec = load_pipeline(spec_path("default"))
    builder = PartialBuilder(spec, "w")
    binary = Encoding.parse("binary")
    now = START_MS + 30
    out = []
    for g in range(10):
        gateway = f"gw{g:02d}"
        field = SensorField(gateway, 1_000, 600.0, START_MS, seed=g)
        for seq in range(20):
            block = field.take(START_MS + 27 * (seq + 1)).slice(0, ROWS)
            payload = encode_batch(
                block, gateway_id=gateway, seq=seq, sent_at_ms=now, encoding=binary
            )
            decoded = decode_batch(
                payload, content_type=binary.content_type, limits=spec.limits, now_ms=now
            )
            info = BatchInfo(gateway, seq, "w", decoded.rows, None, None, now, now, "w")
            out += [Partial.decode(p.encode()) for p in builder.build_batch(decoded, info, now)]
    return out


def main() -> None:
    """Measure and print one JSON line."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    spec = load_pipeline(spec_path("default"))
    partials = _partials()
    best = float("inf")
    for _ in range(rounds):
        state = WindowState(spec, spec.plan())
        spent = 0.0
        for partial in partials:
            assert partial.rows is not None
            started = time.perf_counter()
            state.add(partial.rows)
            spent += time.perf_counter() - started
            state.tidy()
        best = min(best, spent / len(partials))
    record = {"partials": len(partials), "add_us": round(best * 1e6, 1)}
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
