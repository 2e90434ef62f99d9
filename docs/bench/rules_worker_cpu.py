"""Worker CPU per 16,000-row binary batch, with and without a row stage (docs/benchmarks.md).

Run from the repository root::

    python docs/bench/rules_worker_cpu.py WHERE [DERIVED_VALUE] [--functions udf|udaf]

The default pipeline's aggregates, once plain and once with ``where = WHERE`` and
``derive.value = DERIVED_VALUE`` plus ``derive.plausible``; 200 batches each, interleaved.
``--functions udf`` adds the UDF example's ``calibrate`` (``processors/examples/udf.toml``)
and ``udaf`` the ``ewm`` aggregate (``udaf-ewm.toml``); either way the rules side then runs
as a worker runs it, through the pipeline's guard (a thread per batch, under its budget).
CPU is ``process_time``: every thread of the process. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import polars as pl

from shoal.control.canonical import canonical_mapping
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import (
    PipelineSpec,
    inline_function_files,
    load_pipeline,
    parse_pipeline,
)
from shoal.rules.guard import FunctionGuard
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
    args = sys.argv[1:]
    functions = None
    if "--functions" in args:
        at = args.index("--functions")
        functions = args[at + 1]
        del args[at : at + 2]
    where = args[0]
    value = args[1] if len(args) > 1 else "value"
    base = canonical_mapping(load_pipeline(Path("processors/default.toml")))
    base["limits"]["max_future_ms"] = False
    plain = parse_pipeline(base)
    derive = {"value": value, "plausible": "value > -60 AND value < 160"}
    extra = _functions(functions)
    if functions == "udaf":
        extra["aggregates"] = [*base["aggregates"], "ewm"]
    ruled = parse_pipeline({**base, "where": where, "derive": derive, **extra})
    data = payload()
    times: dict[str, list[float]] = {"plain": [], "rules": []}
    builders = {"plain": PartialBuilder(plain, "w"), "rules": PartialBuilder(ruled, "w")}
    specs: dict[str, PipelineSpec] = {"plain": plain, "rules": ruled}
    guard = FunctionGuard(10.0, 3, time.monotonic) if ruled.calls_functions else None
    loop = asyncio.new_event_loop()
    for rep in range(REPS):
        for name, builder in builders.items():
            started = time.process_time()
            batch = decode_batch(data, limits=specs[name].limits, now_ms=0)
            info = BatchInfo("gw", rep, "s", batch.rows, None, None, 0, 0, "w")
            if name == "rules" and guard is not None:
                loop.run_until_complete(
                    guard.run(lambda b=batch, i=info, w=builder: w.build_batch(b, i, 0))
                )
            else:
                builder.build_batch(batch, info, 0)
            times[name].append(time.process_time() - started)
    loop.close()
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    p10 = {k: sorted(v)[len(v) // 10] for k, v in times.items()}
    record = {
        "where": where,
        "derive_value": value,
        **({"functions": functions} if functions else {}),
        "rows_per_batch": ROWS,
        "plain_ms_median": round(median["plain"] * 1e3, 2),
        "rules_ms_median": round(median["rules"] * 1e3, 2),
        "throughput_ratio_median": round(median["plain"] / median["rules"], 3),
        "throughput_ratio_p10": round(p10["plain"] / p10["rules"], 3),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    sys.stdout.write(json.dumps(record) + "\n")


def _functions(which: str | None) -> dict[str, object]:
    """The ``functions`` of the UDF or UDAF example (None: none)."""
    if which is None:
        return {}
    examples = Path("processors/examples")
    name = {"udf": "udf.toml", "udaf": "udaf-ewm.toml"}[which]
    raw = inline_function_files(tomllib.loads((examples / name).read_text()), examples)
    functions = raw["functions"]
    if which == "udf":
        functions = {"calibrate": functions["calibrate"]}
    return {"functions": functions}


if __name__ == "__main__":
    main()
