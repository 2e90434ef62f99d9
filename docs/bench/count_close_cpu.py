"""CPU seconds per close step of a count-window combiner at 10,000 keys, two trees.

``.venv/bin/python docs/bench/count_close_cpu.py BASE_SRC [REPEATS]`` makes scenario B's
partials once (10 gateways of 1,000 sensors at ``RATE_HZ``/s, the default pipeline with
the ``count-250`` preset, 16,000-row batches: the rows workers ship for count windows;
cached as ``cntclose-partials-*`` in the temporary folder), then drives a ``Combiner`` core
with them, in a fresh process per repeat, alternating between ``BASE_SRC`` (a checkout's
``src``, e.g. ``main``'s) and this tree's ``src``: every round the gateways' partials, then
a tick (a close step every ``COUNT_CLOSE_INTERVAL_MS`` of the injected clock, as the
runtime's). Each process times, in CPU seconds (``time.process_time``, outermost call
only), the close path's parts: ``order`` (``CountState._in_event_order``: the step's final
rows in event order), ``fill`` (``CountState._fill``: numbering, the registry's kernels,
unfinished windows, results), ``finalise`` (the whole close step, both of those included)
and ``combiner``, the whole combiner (``receive`` + ``tick``, partials already decoded).
Prints per tree the median of the repeats per close step, and a digest of every published
frame so that both trees' results can be compared (equal digests: identical results).
Figures: docs/benchmarks.md, "Count windows: the close step (session 10)".
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from shoal._resources import resource_dir
from shoal.clock import FakeClock
from shoal.loadtest.bench_windows import with_window
from shoal.loadtest.data import SensorField
from shoal.processors.combine import Combiner
from shoal.processors.count import CountState
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

GATEWAYS = 10
SENSORS = 1_000
RATE_HZ = 250
SECONDS = 8
BATCH = 16_000
START_MS = 1_700_000_000_000
PARTS = ("order", "fill", "finalise", "combiner")
HERE = Path(__file__).resolve()
OWN_SRC = HERE.parents[2] / "src"


def _cache() -> Path:
    return Path(tempfile.gettempdir()) / f"cntclose-partials-{SENSORS}-{RATE_HZ}-{SECONDS}.msgpack"


def make_partials() -> None:
    """Every round's encoded partials, as a worker makes them (cached across runs)."""
    cache = _cache()
    if cache.exists():
        return
    spec = _spec()
    fields = [
        SensorField(f"gw{g:02d}", SENSORS, RATE_HZ, START_MS, seed=g) for g in range(GATEWAYS)
    ]
    builder = PartialBuilder(spec, "w")
    tick_ms = int(BATCH / (SENSORS * RATE_HZ) * 1000)
    now = START_MS
    rounds: list[list[bytes]] = []
    for seq in range(int(SECONDS * 1000 / tick_ms)):
        now += tick_ms
        batch = []
        for field in fields:
            payload = encode_batch(
                field.take(now), gateway_id=field.gateway_id, seq=seq, sent_at_ms=0,
                encoding=Encoding.BINARY_COLUMNAR,
            )  # fmt: skip
            info = BatchInfo(field.gateway_id, seq, "s", 0, None, None, 0, 0, "w")
            batch += [p.encode() for p in builder.build_batch(decode_batch(payload), info, 0)]
        rounds.append(batch)
    cache.write_bytes(msgpack.packb([tick_ms, rounds]))


def _load() -> tuple[int, list[list[bytes]]]:
    tick_ms, rounds = msgpack.unpackb(_cache().read_bytes())
    return int(tick_ms), rounds


def _spec() -> Any:
    raw = tomllib.loads((resource_dir("processors") / "default.toml").read_text())
    return parse_pipeline({**with_window(raw, "count"), "limits": {"max_future_ms": False}})


_DEPTH = [0]  # shared by the timers: a CPU second counts for the outermost timed call only


def _timed(owner: type, name: str, totals: dict[str, float], label: str) -> None:
    """Wrap ``owner.name`` to add its CPU seconds to ``totals[label]`` (outermost call only)."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _DEPTH[0]:
            return inner(*args, **kwargs)
        _DEPTH[0] += 1
        began = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.process_time() - began
            _DEPTH[0] -= 1

    setattr(owner, name, wrapper)


def run_once() -> dict[str, Any]:
    """One pass of the combiner over the cached partials: CPU seconds by part, a digest."""
    tick_ms, rounds = _load()
    totals = dict.fromkeys(PARTS, 0.0)
    _timed(CountState, "_in_event_order", totals, "order")
    _timed(CountState, "_fill", totals, "fill")
    finalise = {"cpu_s": 0.0, "calls": 0}  # the parts above run inside it: timed apart
    inner: Callable[..., Any] = CountState.finalise

    def timed_finalise(*args: Any, **kwargs: Any) -> Any:
        began = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            finalise["cpu_s"] += time.process_time() - began
            finalise["calls"] += 1

    CountState.finalise = timed_finalise  # type: ignore[method-assign]
    spec, clock = _spec(), FakeClock()
    combiner = Combiner(spec, 0, clock, memory_bytes=None)
    for g in range(GATEWAYS):
        combiner.receive_status(GatewayStatus(f"gw{g:02d}", "s", 0, 0, 0, 0, None, 0, 0, START_MS))
    digest, results = hashlib.sha256(), 0
    for batch in rounds:
        decoded = [Partial.decode(p) for p in batch]
        began = time.process_time()
        for partial in decoded:
            combiner.receive(partial)
        clock.advance(tick_ms)
        closed = combiner.tick().closed
        totals["combiner"] += time.process_time() - began
        if closed is not None and not closed.empty:
            frame = closed.frame.sort("window", "key", "index")
            digest.update(frame.hash_rows(seed=0).to_numpy().tobytes())  # values, not layout
            results += frame.height
    totals["finalise"] = finalise["cpu_s"]
    steps = int(finalise["calls"])
    per_step = {k: v / max(steps, 1) for k, v in totals.items()}
    return {"steps": steps, "results": results, "digest": digest.hexdigest()[:16], **per_step}


def main(base_src: str, repeats: int) -> None:
    """Alternate base and this tree, ``repeats`` processes each; print medians per step."""
    env = {**os.environ, "PYTHONPATH": str(OWN_SRC)}
    subprocess.run([sys.executable, str(HERE), "--make"], check=True, env=env)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    for _ in range(repeats):
        for name, src in (("base", base_src), ("this", str(OWN_SRC))):
            out = subprocess.run(
                [sys.executable, str(HERE), "--once"],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": src},
            ).stdout
            runs[name].append(json.loads(out))
    for name, records in runs.items():
        first = records[0]
        medians = {k: round(statistics.median(r[k] for r in records), 4) for k in PARTS}
        sys.stdout.write(
            json.dumps(
                {
                    "tree": name,
                    "steps": first["steps"],
                    "results": first["results"],
                    "digests": sorted({r["digest"] for r in records}),
                    "cpu_s_per_step_median": medians,
                    "load": os.getloadavg(),
                }
            )
            + "\n"
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["--make"]:
        make_partials()
    elif sys.argv[1:] == ["--once"]:
        sys.stdout.write(json.dumps(run_once()) + "\n")
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
