"""Benchmark: a worker's state for one hopping 60 s / 1 s batch, per pane against per membership.

``make bench`` (or ``pytest -m benchmark -s tests/unit/processors/test_bench_panes.py``)
prints the median time per 16,000-row scenario B batch (10,000 sensors at 1 Hz, binary
columnar, p50/p95/p99 included) of the state kernels both ways: grouping every measurement once
per window (``Assignment.expanded``, what the worker did before panes) and grouping it once
per pane, then fanning the pane states out (``_panes.fan_out``, what it does now). Figures:
docs/benchmarks.md, "Pane-based hopping".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from shoal.loadtest.data import SensorField
from shoal.processors._kernels import partial_state
from shoal.processors._panes import fan_out
from shoal.processors.aggregates import AggregatePlan
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import parse_pipeline
from shoal.processors.windows import kind_of
from shoal.schemas import Encoding, decode_batch, encode_batch

pytestmark = pytest.mark.benchmark

AGGREGATES = ["count", "mean", "min", "max", "p50", "p95", "p99"]


def _median_ms(run: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return 1000 * sorted(times)[repeat // 2]


@pytest.mark.parametrize("key", ["type", "sensor_id"])
def test_panes_beat_memberships(key: str) -> None:
    spec = parse_pipeline(
        {
            "name": "bench",
            "key": key,
            "aggregates": AGGREGATES,
            "windows": [{"kind": "hopping", "size_ms": 60_000, "slide_ms": 1_000}],
        }
    )
    window, plan = spec.windows[0], AggregatePlan.for_aggregates(spec.aggregates)
    field = SensorField("gw00", 10_000, 1.0, 1_700_000_000_000, attributes=True)
    payload = encode_batch(
        field.take(1_700_000_001_600),
        gateway_id="gw00",
        seq=0,
        sent_at_ms=0,
        encoding=Encoding.BINARY_COLUMNAR,
    )
    batch = decode_batch(payload)
    coded = batch.codes[key]
    keys, width = coded.codes.astype(np.int64), len(coded.values)
    ts, value = batch.ts, batch.value
    bucket = LogBuckets(spec.sketch_accuracy).keys_np(value)
    panes = kind_of(window).assign(ts, window)
    every = panes.expanded()
    n = every.per_row

    def per_membership() -> object:
        groups = every.slot * width + np.repeat(keys, n)
        return partial_state(
            groups, np.repeat(ts, n), np.repeat(value, n), plan.fields, np.repeat(bucket, n)
        )

    def per_pane() -> object:
        return fan_out(panes.slot, panes.fan, keys, width, ts, value, plan.fields, bucket)

    before, after = _median_ms(per_membership), _median_ms(per_pane)
    print(
        f"\nhopping 60s/1s, key={key} ({width} keys), {len(ts)} rows: "
        f"per membership {before:.1f} ms, per pane {after:.1f} ms ({before / after:.1f}x)"
    )
    assert after < before
