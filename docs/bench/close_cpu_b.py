"""A combiner's CPU at each window close of scenario B, in one process, and what rendering costs.

Run from the repository root (docs/benchmarks.md, "Worker and close path at scenarios A and
B: first/last by index, the close log's flush measured, the array rendered ahead")::

    python docs/bench/close_cpu_b.py [SECONDS]

10 gateways x 1,000 sensors at 25/s in 16,000-row binary batches (scenario B), SECONDS of
event time (default 65: six 10 s windows), turned into partials by two ``PartialBuilder``s
first; then a ``Combiner`` core of the default pipeline applies them, its clock following the
batches, with ``WindowState.tidy`` after each partial and ``close_ready`` after each round of
10 (as the runtime does between messages). Prints, per closing window, the CPU of the
``close_ready`` that closed it (``time.process_time_ns``; the window was finalised ahead,
``WindowState.prepare``), then of ``ndjson_rows`` and ``json_rows`` of its 10,000 rows, which
the runtime renders ahead of the close (``CombinerRuntime._render_ahead``).
"""

from __future__ import annotations

import json
import sys
import time

from shoal._cli.common import spec_path
from shoal.clock import FakeClock
from shoal.loadtest.data import SensorField
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.results import json_rows, ndjson_rows, split_windows
from shoal.processors.spec import load_pipeline
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

START_MS = 1_700_000_000_000
GATEWAYS = [f"gw-{g}" for g in range(10)]
ROWS = 16_000


def main() -> None:
    """Build the partials, apply them, print one JSON line."""
    seconds = int(sys.argv[1]) if len(sys.argv) > 1 else 65
    spec = load_pipeline(spec_path("default"))
    codec = Encoding.parse("binary")
    fields = {g: SensorField(g, 1_000, 25.0, START_MS, attributes=False) for g in GATEWAYS}
    builders = [PartialBuilder(spec, "w1"), PartialBuilder(spec, "w2")]
    period_ms = ROWS / (1_000 * 25.0) * 1000
    rounds: list[tuple[int, list[bytes]]] = []
    for step in range(int(seconds * 1000 / period_ms)):
        sealed = START_MS + int((step + 1) * period_ms) + 1
        encoded = []
        for i, gateway in enumerate(GATEWAYS):
            payload = encode_batch(
                fields[gateway].take(sealed),
                gateway_id=gateway,
                seq=step,
                sent_at_ms=sealed,
                encoding=codec,
            )
            decoded = decode_batch(
                payload, content_type=codec.content_type, limits=spec.limits, now_ms=sealed
            )
            info = BatchInfo(gateway, step, "s", decoded.rows, None, None, sealed, sealed, "w")
            built = builders[i % 2].build_batch(decoded, info, sealed)
            encoded += [p.encode() for p in built]
        rounds.append((sealed, encoded))
    clock = FakeClock(START_MS)
    combiner = Combiner(spec, 0, clock)
    for gateway in GATEWAYS:
        combiner.receive_status(GatewayStatus(gateway, "s", 10_000, 0, 10_000, 0, None, 0, 0, 0))
    close_ms, ndjson_ms, array_ms = [], [], []
    for sealed, encoded in rounds:
        clock.advance(sealed - clock.now_ms())
        for data in encoded:
            combiner.receive(Partial.decode(data))
            combiner.state.tidy()
        started = time.process_time_ns()
        closed = combiner.close_ready(sealed)
        closing = time.process_time_ns() - started
        if closed is None or closed.empty:
            continue
        close_ms.append(round(closing / 1e6, 2))
        for result in split_windows(closed.frame, closed.revisions, closed.sessions):
            started = time.process_time_ns()
            lines = ndjson_rows(result)
            rendered = time.process_time_ns()
            json_rows(result, lines)
            ndjson_ms.append(round((rendered - started) / 1e6, 2))
            array_ms.append(round((time.process_time_ns() - rendered) / 1e6, 2))
    record = {"close_ready_ms": close_ms, "ndjson_rows_ms": ndjson_ms, "json_rows_ms": array_ms}
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
