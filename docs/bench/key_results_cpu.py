"""CPU seconds a combiner's step spends publishing a window's per-key results and message.

``.venv/bin/python docs/bench/key_results_cpu.py KEYS STEPS SRC [SRC ...]`` runs, for each
checkout's ``src`` folder in turn (alternated, each in a fresh process, ``PYTHONPATH=SRC``),
STEPS steps against an embedded Mosquitto (the ``dev`` profile, 16 MB packet limit): a window
result of KEYS keys with the default aggregates (random values, rounded as sensors send
them, in key order as a combiner's window frame is) encoded as the combiner does it (NDJSON
lines rendered ahead, the window message split to fit, published QoS 1 and awaited), then
its retained per-key results held behind a barrier as behind the close log, released, and
published in slices of 1,000 with the loop free in between, as
``CombinerRuntime._publish_keys`` does (the checkout's own ``key_rests`` path when it has
one). Prints one JSON line per checkout and step: CPU ms by
phase (``time.process_time``), and the median over steps at the end.
Figures: docs/benchmarks.md, "Per-key results in bulk (branch slpub)".
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import polars as pl

from shoal.broker import BatchedSession, EmbeddedBroker
from shoal.broker.held import HeldSession
from shoal.processors import results
from shoal.processors.result_parts import body_budget, split_result
from shoal.schemas.topics import Topics

WINDOW, START, END, AT = "sliding-10s-1s", 1_700_000_001_000, 1_700_000_011_000, 1_700_000_012_000
SLICE, BLOCK = 1_000, 20_000


def frame_of(keys: int, seed: int = 0) -> pl.DataFrame:
    """A window's result rows as the default pipeline computes them (its columns and types)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(-10, 40, keys)

    def near() -> np.ndarray:
        return np.round(base + rng.normal(0, 0.5, keys), 3)

    stddev = rng.uniform(0.1, 1.0, keys)
    stddev[rng.random(keys) < 0.01] = np.nan  # a key with one value: null
    return (
        pl.DataFrame(
            {
                "key": [f"gw{k % 10:02d}-s{k // 10:04d}" for k in range(keys)],
                "rows": np.full(keys, 10),
                "batches": rng.integers(1, 10, keys),
                "count": np.full(keys, 10),
                "mean": base + rng.normal(0, 0.1, keys),
                "min": near(),
                "max": near(),
                "stddev": stddev,
                "first": near(),
                "last": near() + 1e-12,  # a float sum: 17 digits
                "p50": base * 1.0001,
                "p95": base * 1.0203,
                "p99": base * 1.0407,
            }
        )
        .with_columns(pl.col("stddev").fill_nan(None))
        .sort("key")
    )  # a combiner's: in key order


def window_messages(
    result: results.WindowResult, ctx: results.Emission, lines: bytes, budget: int | None
) -> list[bytes]:
    """The window message's parts, as the combiner encodes them from rendered lines."""
    split = split_result(result, budget, lines=lines.splitlines())
    bodies = split.bodies or [results.json_rows(result, lines)]
    return [results.window_json(p, ctx, b) for p, b in zip(split.parts, bodies, strict=True)]


async def run(keys: int, steps: int) -> list[dict[str, float]]:
    """STEPS measured steps (after one that warms the caches): CPU ms by phase, each."""
    frame = frame_of(keys)
    result = results.WindowResult(WINDOW, START, END, frame)
    ctx = results.Emission("default", 0, 1, END, AT)
    topics = Topics()
    known: dict[Any, str] = {}
    bulk = hasattr(results, "key_columns")
    out = []
    phases: dict[str, float] = {}

    def timed(phase: str, work: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.process_time()
        value = work(*args, **kwargs)
        phases[phase] = phases.get(phase, 0.0) + time.process_time() - began
        return value

    def topic_list(keys_: Any) -> list[str]:
        return [known.get(k) or known.setdefault(k, topics.result_key("default", k)) for k in keys_]

    def slices_main(lines: bytes) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
        split, out = lines.splitlines(), []
        for block in range(0, frame.height, BLOCK):
            part = replace(result, frame=frame.slice(block, BLOCK))
            head, messages = results.key_payloads(part, "default", AT, split[block : block + BLOCK])
            for offset in range(0, len(messages), SLICE):
                chunk = messages[offset : offset + SLICE]
                out.append((head, [(known.get(k) or topic_list([k])[0], p) for k, p in chunk]))
        return out

    def slices_bulk(lines: bytes) -> list[tuple[bytes, Any, Any]]:
        head, names, rests = results.key_columns(result, "default", AT, lines)
        found = list(map(known.get, names))
        named = found if None not in found else topic_list(names)
        return [
            (head, named[offset : offset + SLICE], rests[offset : offset + SLICE])
            for offset in range(0, len(names), SLICE)
        ]

    with EmbeddedBroker() as broker:
        async with BatchedSession(broker.settings, "bench") as session:
            budget = body_budget(session.max_packet_size)
            for _ in range(steps + 1):  # the first warms the topic caches: not counted
                phases.clear()
                began = time.process_time()
                lines = timed("render", results.ndjson_rows, result)
                payloads = timed("window_message", window_messages, result, ctx, lines, budget)
                futures = timed(
                    "window_publish",
                    lambda parts=payloads: [
                        session.publish_started("shoal/results/default", p) for p in parts
                    ],
                )
                await session.wait_published(futures)
                held = HeldSession(session)
                barrier = asyncio.get_running_loop().create_future()
                held.hold_until(barrier)
                if bulk:  # this checkout's way: columns
                    slices = timed("key_payloads", slices_bulk, lines)
                    for head, names, rests in slices:
                        await asyncio.sleep(0)
                        timed(
                            "key_publish",
                            held.publish_columns,
                            names,
                            rests,
                            retain=True,
                            head=head,
                        )
                else:
                    for head, messages in timed("key_payloads", slices_main, lines):
                        await asyncio.sleep(0)
                        timed("key_publish", held.publish_many, messages, retain=True, head=head)
                released = time.process_time()
                barrier.set_result(None)
                await asyncio.sleep(0)  # the barrier's callback hands the held results over
                phases["release"] = time.process_time() - released
                await session.publish("shoal/results/_step", b"", qos=1)
                phases["total"] = time.process_time() - began
                out.append({k: round(v * 1000, 1) for k, v in phases.items()})
    return out[1:]


def main(argv: list[str]) -> None:
    """Alternate the checkouts, a fresh process each; print each step and the medians."""
    if argv[0] == "--child":
        for record in asyncio.run(run(int(argv[1]), int(argv[2]))):
            sys.stdout.write(json.dumps(record) + "\n")
        return
    keys, steps, sources = argv[0], argv[1], argv[2:]
    got: dict[str, list[dict[str, float]]] = {s: [] for s in sources}
    for _ in range(2):
        for source in sources:
            env = {**os.environ, "PYTHONPATH": source}
            command = [sys.executable, __file__, "--child", keys, steps]
            lines = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            for line in lines.stdout.splitlines():
                record = json.loads(line)
                got[source].append(record)
                sys.stdout.write(json.dumps({"src": source, **record}) + "\n")
    for source, records in got.items():
        medians = {k: statistics.median(r[k] for r in records) for k in records[0]}
        summary = {"src": source, "median_ms": medians, "steps": len(records)}
        sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
