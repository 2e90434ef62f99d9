"""Benchmark: what a window kind costs a worker and a combiner, per CPU second, and in memory.

``pytest -m benchmark -s tests/unit/processors/test_bench_window_kinds.py`` runs the default
pipeline with its window replaced by a ``shoal bench pipeline --window`` preset (or a sliding
window of another step) over scenario B's data (10 gateways, 16,000-row binary batches) in
one process per configuration: a worker's decode + partials + encode, and a combiner's
decode + merge + close + result messages (window JSON and per-key payloads), each timed in
CPU seconds (the combiner's also by phase: ``apply`` decode and merge of partials,
``close`` the ticks that close windows, ``emit`` the result messages, ``checkpoint`` a
snapshot every ``checkpoint_interval_ms`` of event time, as the runtime takes one on its
event loop), so the figures hold
on a busy machine where ``shoal bench pipeline --max`` does not; and the process's peak RSS.
Figures: docs/benchmarks.md, "Window kinds".
``python -m tests.unit.processors.test_bench_window_kinds KIND SENSORS RATE SECONDS [STEP]``
runs one configuration (100,000 keys: ``sliding 10000 1 40``). With ``--staggered`` the
gateways' batches arrive one after the other, each gateway's ``1/GATEWAYS`` of a batch later
than the one before it (as gateways that started at different times send them), and the
combiner is driven as its runtime drives it: ``close_ready`` after every partial, ``tick``
every ``TICK_MS`` of the (injected) clock; the pipeline watermark then moves with every batch.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from shoal._resources import resource_dir
from shoal.clock import FakeClock
from shoal.loadtest.bench_windows import with_window
from shoal.loadtest.data import SensorField
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.results import (
    Emission,
    json_rows,
    key_payloads,
    ndjson_rows,
    split_windows,
    window_json,
)
from shoal.processors.spec import parse_pipeline
from shoal.processors.state import ClosedWindows
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

T = TypeVar("T")

GATEWAYS = 10
BATCH = 16_000
TICK_MS = 100
"""The runtime's ``CombinerConfig.tick_ms`` (``--staggered``)."""


def measure(
    kind: str,
    sensors: int,
    rate_hz: float,
    seconds: float,
    step_ms: int = 0,
    *,
    staggered: bool = False,
) -> dict:
    """One configuration: measurements per CPU second of a worker and a combiner, peak RSS."""
    raw = tomllib.loads((resource_dir("processors") / "default.toml").read_text())
    variant: dict[str, Any] = with_window(raw, kind)
    if step_ms:
        variant["windows"][0].update(step_ms=step_ms, name=f"sliding-{step_ms}")
    spec = parse_pipeline({**variant, "limits": {"max_future_ms": False}})
    fields = [
        SensorField(f"gw{g:02d}", sensors, rate_hz, 1_700_000_000_000, seed=g)
        for g in range(GATEWAYS)
    ]
    builder, clock = PartialBuilder(spec, "w"), FakeClock()
    combiner = Combiner(spec, 0, clock)
    tick_ms = int(BATCH / (sensors * rate_hz) * 1000)
    worker_s = 0.0
    phases = dict.fromkeys(("apply", "close", "emit", "checkpoint"), 0.0)  # combiner CPU s
    checkpoint_at = 1_700_000_000_000 + spec.checkpoint_interval_ms
    rows = results = 0
    now = 1_700_000_000_000
    for field in fields:  # announced, as gateways do: their batches apply from seq 0 on
        combiner.receive_status(GatewayStatus(field.gateway_id, "s", 0, 0, 0, 0, None, 0, 0, now))
    clock_base = ticked_at = clock.now_ms()
    steps: list[int] = []  # result rows of each close that published any

    def emit(closed: ClosedWindows | None) -> int:
        if closed is None or closed.empty:
            return 0
        steps.append(closed.frame.height)
        ctx = Emission(spec.name, 0, 1, combiner.closed_through, 0)
        emitted = 0
        for result in split_windows(closed.frame, closed.revisions):
            lines = ndjson_rows(result)  # encoded once for both, as the runtime does
            window_json(result, ctx, json_rows(result, lines))
            emitted += len(key_payloads(result, spec.name, 0, lines.splitlines())[1])
        return emitted

    def apply(partials: list[bytes]) -> None:
        for partial in partials:
            combiner.receive(Partial.decode(partial))

    def ticked() -> ClosedWindows | None:
        return combiner.tick().closed

    def timed(phase: str, work: Callable[..., T], *args: Any) -> T:
        began = time.process_time()
        out = work(*args)
        phases[phase] += time.process_time() - began
        return out

    for seq in range(int(seconds * 1000 / tick_ms)):
        now += tick_ms
        for g, field in enumerate(fields):
            # staggered: gateway g's batch is sealed g/GATEWAYS of a batch later than gw00's
            sealed = now + (g * tick_ms // GATEWAYS if staggered else 0)
            block = field.take(sealed)
            payload = encode_batch(
                block, gateway_id=field.gateway_id, seq=seq, sent_at_ms=0,
                encoding=Encoding.BINARY_COLUMNAR,
            )  # fmt: skip
            began = time.process_time()
            info = BatchInfo(field.gateway_id, seq, "s", 0, None, None, 0, 0, "w")
            partials = [p.encode() for p in builder.build_batch(decode_batch(payload), info, 0)]
            worker_s += time.process_time() - began
            rows += len(block.ts)
            if not staggered:
                timed("apply", apply, partials)
                continue
            clock.advance(clock_base + (seq + 1) * tick_ms + (sealed - now) - clock.now_ms())
            timed("apply", apply, partials)
            # the runtime's ``_on_message``: close what can close after every partial
            closed = timed("close", combiner.close_ready, clock.now_ms())
            results += timed("emit", emit, closed)
            while clock.now_ms() - ticked_at >= TICK_MS:  # the runtime's ticker
                ticked_at += TICK_MS
                closed = timed("close", ticked)
                results += timed("emit", emit, closed)
        if not staggered:
            clock.advance(tick_ms)
            closed = timed("close", ticked)
            results += timed("emit", emit, closed)
        if now >= checkpoint_at:
            checkpoint_at += spec.checkpoint_interval_ms
            timed("checkpoint", combiner.snapshot_buffer)  # as the runtime writes it
    combiner_s = sum(phases.values())
    return {
        "window": spec.windows[0].name,
        "arrivals": "staggered" if staggered else "in rounds",
        "keys": GATEWAYS * sensors,
        "measurements": rows,
        "worker_meas_per_cpu_s": round(rows / worker_s),
        "combiner_meas_per_cpu_s": round(rows / combiner_s),
        "results": results,
        "result_messages": len(steps),
        "combiner_cpu_s": {name: round(seconds, 2) for name, seconds in phases.items()},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _in_fresh_process(*args: object) -> dict:
    """``measure`` in its own process, so that its peak RSS is its own."""
    command = [sys.executable, "-m", __name__, *(str(a) for a in args)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


@pytest.mark.benchmark
def test_sliding_costs_grow_with_windows_per_row() -> None:
    tumbling = _in_fresh_process("tumbling", 1_000, 25, 30)
    by_step = {s: _in_fresh_process("sliding", 1_000, 25, 30, s) for s in (1_000, 2_000, 5_000)}
    for record in (tumbling, *by_step.values()):
        print(json.dumps(record))
    coarse, fine = by_step[5_000], by_step[1_000]
    assert coarse["combiner_meas_per_cpu_s"] > fine["combiner_meas_per_cpu_s"]
    assert coarse["results"] < fine["results"]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--staggered"]
    kind, sensors, rate, seconds, *step = args
    record = measure(
        kind,
        int(sensors),
        float(rate),
        float(seconds),
        int(step[0]) if step else 0,
        staggered="--staggered" in sys.argv[1:],
    )
    print(json.dumps(record))
