"""Benchmark: CPU per measurement of the worker's and the combiner's cores, by window kind.

In process, no broker (so other load on the machine matters less than for
``shoal bench pipeline``): ten simulated gateways (``SensorField``) encode 16,000-row binary
batches; the worker's part (decode, partials, their wire form) and the combiner's part
(receive, tick, closes) are timed with ``time.process_time``. A window kind must cost at most
twice what tumbling does per measurement (docs/benchmarks.md, "Window kinds").
"""

from __future__ import annotations

import time
import tomllib

import pytest

from shoal._resources import resource_dir
from shoal.clock import FakeClock
from shoal.loadtest.bench_windows import with_window
from shoal.loadtest.data import SensorField
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

T0 = 1_700_000_000_000
BATCH = 16_000


def cost_us_per_row(kind: str, sensors: int, rate: float, seconds: float) -> tuple[float, float]:
    """(worker, combiner) CPU microseconds per measurement for the ``kind`` preset."""
    raw = tomllib.loads((resource_dir("processors") / "default.toml").read_text())
    spec = parse_pipeline({**with_window(raw, kind), "limits": {"max_future_ms": False}})
    fields = [SensorField(f"gw{g:02d}", sensors, rate, T0, seed=g) for g in range(10)]
    step = int(BATCH / (sensors * rate) * 1000)
    payloads = []
    for gateway, field in enumerate(fields):
        for seq, until in enumerate(range(T0 + step, T0 + int(seconds * 1000), step)):
            block = field.take(until)
            payload = encode_batch(
                block,
                gateway_id=field.gateway_id,
                seq=seq,
                sent_at_ms=until,
                encoding=Encoding.BINARY_COLUMNAR,
            )
            payloads.append((until, gateway, seq, payload))
    payloads.sort()
    clock = FakeClock(T0)
    builder = PartialBuilder(spec, "w")
    combiner = Combiner(spec, 0, clock)
    for gateway, field in enumerate(fields):
        count = sum(1 for p in payloads if p[1] == gateway)
        status = GatewayStatus(field.gateway_id, "s", count, 0, count, 0, None, 0, 0, T0)
        combiner.receive_status(status)
    worker_s = combiner_s = 0.0
    rows = 0
    for until, gateway, seq, payload in payloads:
        clock.advance(max(0, until - clock.now_ms()))
        began = time.process_time()
        batch = decode_batch(payload, limits=spec.limits, now_ms=until)
        info = BatchInfo(
            fields[gateway].gateway_id, seq, "s", batch.rows, None, None, until, until, "w"
        )
        partials = [Partial.decode(p.encode()) for p in builder.build_batch(batch, info, until)]
        built = time.process_time()
        for partial in partials:
            combiner.receive(partial)
        combiner.tick()
        worker_s += built - began
        combiner_s += time.process_time() - built
        rows += batch.rows
    assert combiner.counters.rows_applied == rows
    return worker_s / rows * 1e6, combiner_s / rows * 1e6


@pytest.mark.benchmark
@pytest.mark.parametrize(("sensors", "rate"), [(1_000, 25.0), (10_000, 2.5)])
@pytest.mark.parametrize("kind", ["session"])
def test_a_window_kind_costs_at_most_twice_tumbling(kind: str, sensors: int, rate: float) -> None:
    base = cost_us_per_row("tumbling", sensors, rate, 30)
    other = cost_us_per_row(kind, sensors, rate, 30)
    print(
        f"\n{sensors * 10:,} keys: tumbling worker {base[0]:.2f} combiner {base[1]:.2f} us/row; "
        f"{kind} worker {other[0]:.2f} combiner {other[1]:.2f} us/row"
    )
    assert other[0] <= 2 * base[0]
    assert other[1] <= 2 * base[1]
