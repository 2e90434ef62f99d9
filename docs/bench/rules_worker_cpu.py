"""Worker CPU per 16,000-row binary batch, with and without a row stage (docs/benchmarks.md).

Run from the repository root::

    python docs/bench/rules_worker_cpu.py WHERE [DERIVED_VALUE]

The default pipeline's aggregates, once plain and once with ``where = WHERE`` and
``derive.value = DERIVED_VALUE`` plus ``derive.plausible``; 200 batches each, interleaved.
Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

from shoal.control.canonical import canonical_mapping
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import PipelineSpec, load_pipeline, parse_pipeline
from shoal.schemas import FRAME_SCHEMA, Encoding, Measurements, decode_batch, encode_batch

ROWS = 16_000
REPS = 200


def payload() -> bytes:
    """One binary batch: 1,000 sensors of four kinds."""
    rng = np.random.default_rng(1)
    kinds = np.array(["temperature", "humidity", "noise", "pm2_5"])
    frame = pl.DataFrame(
        {
            "sensor_id": [f"gw-s{i % 1000:04d}" for i in range(ROWS)],
            "ts": (1_700_000_000_000 + np.sort(rng.integers(0, 1000, ROWS))).astype(np.int64),
            "value": rng.normal(20, 8, ROWS),
            "name": None,
            "type": kinds[rng.integers(0, 4, ROWS)],
            "unit": "degC",
        },
        schema=FRAME_SCHEMA,
    )
    return encode_batch(
        Measurements.from_frame(frame),
        gateway_id="gw",
        seq=0,
        sent_at_ms=0,
        encoding=Encoding.BINARY_COLUMNAR,
    )


def main() -> None:
    """Time both builders and print the record."""
    where = sys.argv[1]
    value = sys.argv[2] if len(sys.argv) > 2 else "value"
    base = canonical_mapping(load_pipeline(Path("processors/default.toml")))
    base["limits"]["max_future_ms"] = False
    plain = parse_pipeline(base)
    derive = {"value": value, "plausible": "value > -60 AND value < 160"}
    ruled = parse_pipeline({**base, "where": where, "derive": derive})
    data = payload()
    times: dict[str, list[float]] = {"plain": [], "rules": []}
    builders = {"plain": PartialBuilder(plain, "w"), "rules": PartialBuilder(ruled, "w")}
    specs: dict[str, PipelineSpec] = {"plain": plain, "rules": ruled}
    for rep in range(REPS):
        for name, builder in builders.items():
            started = time.process_time()
            batch = decode_batch(data, limits=specs[name].limits, now_ms=0)
            info = BatchInfo("gw", rep, "s", batch.rows, None, None, 0, 0, "w")
            builder.build_batch(batch, info, 0)
            times[name].append(time.process_time() - started)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    p10 = {k: sorted(v)[len(v) // 10] for k, v in times.items()}
    record = {
        "where": where,
        "derive_value": value,
        "rows_per_batch": ROWS,
        "plain_ms_median": round(median["plain"] * 1e3, 2),
        "rules_ms_median": round(median["rules"] * 1e3, 2),
        "throughput_ratio_median": round(median["plain"] / median["rules"], 3),
        "throughput_ratio_p10": round(p10["plain"] / p10["rules"], 3),
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
