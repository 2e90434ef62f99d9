"""A worker's CPU per scenario-A batch, in one process: decode, partials, encode.

Run from the repository root (docs/benchmarks.md, "Worker and close path at scenarios A and
B: first/last by index, the close log's flush measured, the array rendered ahead")::

    python docs/bench/worker_batch_cpu.py [BATCHES] [--digest]

50 distinct scenario-A batches (1 gateway, 1,000 sensors at 25/s, 4,000 rows, binary) go
through the path a worker runs per batch: strict ``decode_batch``, ``build_batch`` of the
default pipeline, ``Partial.encode``. Prints p50/p99/mean of ``time.process_time_ns`` per
batch over BATCHES (default 1,000). ``--digest``: the SHA-256 of the 50 batches' encoded
partials instead (equal before and after a change: the partials' bytes did not change).
Run another checkout with ``PYTHONPATH=<checkout>/src`` to compare, alternating.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from shoal._cli.common import spec_path
from shoal.loadtest.data import SensorField
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import load_pipeline
from shoal.schemas import Encoding, decode_batch, encode_batch

ROWS = 4_000
START_MS = 1_700_000_000_000


def _payloads() -> list[tuple[bytes, int]]:
    field = SensorField("gw", 1_000, 25.0, START_MS, attributes=False)
    period_ms = ROWS / (1_000 * 25.0) * 1000
    payloads = []
    for seq in range(50):
        sealed = START_MS + int((seq + 1) * period_ms) + 1
        block = field.take(sealed)
        block = block.slice(0, ROWS) if len(block) > ROWS else block
        payload = encode_batch(
            block, gateway_id="gw", seq=seq, sent_at_ms=sealed, encoding=Encoding.parse("binary")
        )
        payloads.append((payload, sealed))
    return payloads


def main() -> None:
    """Measure (or digest) and print one JSON line."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1_000
    spec = load_pipeline(spec_path("default"))
    builder = PartialBuilder(spec, "w")
    content_type = Encoding.parse("binary").content_type

    def one(payload: bytes, now: int) -> list[bytes]:
        decoded = decode_batch(payload, content_type=content_type, limits=spec.limits, now_ms=now)
        info = BatchInfo("gw", 0, "w", decoded.rows, None, None, now, now, "w")
        return [p.encode() for p in builder.build_batch(decoded, info, now)]

    payloads = _payloads()
    encoded = [one(payload, now) for payload, now in payloads]  # also the warm-up
    if "--digest" in sys.argv:
        digest = hashlib.sha256(b"".join(b for parts in encoded for b in parts)).hexdigest()
        sys.stdout.write(json.dumps({"partials_sha256": digest}) + "\n")
        return
    spent = []
    for i in range(count):
        payload, now = payloads[i % len(payloads)]
        started = time.process_time_ns()
        one(payload, now)
        spent.append(time.process_time_ns() - started)
    spent.sort()
    record = {
        "batches": count,
        "p50_ms": round(spent[len(spent) // 2] / 1e6, 3),
        "p99_ms": round(spent[int(len(spent) * 0.99)] / 1e6, 3),
        "mean_ms": round(sum(spent) / len(spent) / 1e6, 3),
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
