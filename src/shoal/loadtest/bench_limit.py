"""The machine's compute limit: one core decoding and aggregating the benchmark's own batches.

``shoal bench pipeline`` measures it in the same invocation, before the pipeline starts, so
that what the pipeline achieves can be read against what this machine can compute at all:
``efficiency`` = achieved / (limit x cores). The batches are the run's: its encoding, batch
size, sensors per gateway and rate, from the simulator's sensor field. Each is decoded
strictly and turned into partials (``PartialBuilder``, the worker's work), with no broker,
no encoding of partials and no combiner: the CPU seconds of that, in this process, give
measurements per second of one core.
"""

from __future__ import annotations

import time
from typing import Final

from shoal.loadtest.data import SensorField
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.schemas import ATTRIBUTE_COLUMNS, Encoding, decode_batch, encode_batch

DISTINCT_BATCHES: Final = 32
"""Batches made once and decoded in turn (different timestamps and values, same keys)."""
MIN_CPU_S: Final = 1.0
"""CPU time the measurement runs for (after one warm-up pass over the batches)."""


def compute_limit(
    spec: PipelineSpec,
    *,
    batch: int,
    encoding: str,
    sensors: int,
    rate_hz: float,
    min_cpu_s: float = MIN_CPU_S,
) -> float:
    """Measurements per CPU second one core decodes and aggregates (see the module docstring)."""
    codec = Encoding.parse(encoding)
    start_ms = 1_700_000_000_000
    # As ``LocalPipeline.start_simulator``: attributes when the pipeline may read them.
    attributes = spec.key in ATTRIBUTE_COLUMNS or spec.row_rules is not None
    field = SensorField("limit-gw", sensors, rate_hz, start_ms, attributes=attributes)
    period_ms = batch / (sensors * rate_hz) * 1000.0
    # (payload, the clock of the worker that decodes it): each batch is sealed and decoded
    # as its last row is measured, as in the pipeline. One fixed clock for all of them put
    # the later batches of a slow field (32 batches of 16,000 rows at 1,000 meas/s span
    # 512 s of event time) beyond the spec's max_future_ms: "timestamp too far in the future".
    payloads: list[tuple[bytes, int]] = []
    for seq in range(DISTINCT_BATCHES):
        sealed_ms = start_ms + int((seq + 1) * period_ms) + 1
        block = field.take(sealed_ms)
        payloads.append(
            (
                encode_batch(
                    block.slice(0, batch) if len(block) > batch else block,
                    gateway_id="limit-gw",
                    seq=seq,
                    sent_at_ms=sealed_ms,
                    encoding=codec,
                ),
                sealed_ms,
            )
        )
    builder = PartialBuilder(spec, "limit")

    def one(payload: bytes, now: int) -> int:
        decoded = decode_batch(
            payload, content_type=codec.content_type, limits=spec.limits, now_ms=now
        )
        info = BatchInfo("limit-gw", 0, "limit", decoded.rows, None, None, now, now, "limit")
        builder.build_batch(decoded, info, now)
        return decoded.rows

    for payload, now in payloads:
        one(payload, now)
    rows = 0
    started = time.process_time()
    while (spent := time.process_time() - started) < min_cpu_s:
        for payload, now in payloads:
            rows += one(payload, now)
    return rows / max(spent, 1e-9)
