"""CPU seconds per 1-s step of a sliding combiner's close path at 100,000 keys, two trees.

``.venv/bin/python docs/bench/sliding_close_cpu.py BASE_SRC [REPEATS]`` makes scenario B's
partials once (10 gateways of 10,000 sensors at RATE/s, the default pipeline with the
``sliding-10s-1s`` preset, 16,000-row batches; cached as ``slclose-partials-*`` in the
temporary folder),
then drives a ``Combiner`` core with them, in a fresh process per repeat, alternating
between ``BASE_SRC`` (a checkout's ``src``, e.g. ``main``'s) and this tree's ``src``: every
round the gateways' partials, then a tick (closes and ``prepare`` ahead of the next close).
Each process times, in CPU seconds (``time.process_time``, outermost call only), the close
path's parts: ``assemble``, ``WindowState._finish_windows`` (assembling the closing windows
from the pane stacks and finalising them, whether ``prepare`` ahead of the close or the
close itself does it; the panes' compaction inside it included), ``compact``,
``PaneState.compact`` elsewhere (merging the panes' pending rows), ``take_panes``,
``WindowState.take_panes`` (taking the partials' pane rows), and ``combiner``, the whole
combiner (``receive`` + ``tick``, partials already decoded). Prints per tree the median of the
repeats per step (steps: closes that published rows), and a digest of every published
frame so that both trees' results can be compared (equal digests: identical results).
Figures: docs/benchmarks.md, "Sliding close path at 100,000 keys (branch slclose)".
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
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.processors.state import PaneState, WindowState
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

GATEWAYS = 10
SENSORS = 10_000
RATE_HZ = 2.3
SECONDS = 20
BATCH = 16_000
START_MS = 1_700_000_000_000
HERE = Path(__file__).resolve()
OWN_SRC = HERE.parents[2] / "src"


def _cache() -> Path:
    return Path(tempfile.gettempdir()) / f"slclose-partials-{SENSORS}-{RATE_HZ}-{SECONDS}.msgpack"


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
    return parse_pipeline({**with_window(raw, "sliding"), "limits": {"max_future_ms": False}})


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
    totals = dict.fromkeys(("assemble", "compact", "take_panes", "combiner"), 0.0)
    _timed(WindowState, "_finish_windows", totals, "assemble")  # prepare's, or close's
    _timed(WindowState, "take_panes", totals, "take_panes")
    _timed(PaneState, "compact", totals, "compact")  # inside ``assemble``: counted there
    spec, clock = _spec(), FakeClock()
    combiner = Combiner(spec, 0, clock)
    for g in range(GATEWAYS):
        combiner.receive_status(GatewayStatus(f"gw{g:02d}", "s", 0, 0, 0, 0, None, 0, 0, START_MS))
    digest, steps, results = hashlib.sha256(), 0, 0
    for batch in rounds:
        decoded = [Partial.decode(p) for p in batch]
        began = time.process_time()
        for partial in decoded:
            combiner.receive(partial)
        clock.advance(tick_ms)
        closed = combiner.tick().closed
        totals["combiner"] += time.process_time() - began
        if closed is not None and not closed.empty:
            frame = closed.frame.sort("window", "start", "key")
            digest.update(frame.hash_rows(seed=0).to_numpy().tobytes())  # values, not layout
            steps += frame.select("start").n_unique()
            results += frame.height
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
        medians = {
            k: round(statistics.median(r[k] for r in records), 4)
            for k in ("assemble", "compact", "take_panes", "combiner")
        }
        close_path = round(medians["assemble"] + medians["compact"] + medians["take_panes"], 4)
        sys.stdout.write(
            json.dumps(
                {
                    "tree": name,
                    "steps": first["steps"],
                    "results": first["results"],
                    "digests": sorted({r["digest"] for r in records}),
                    "cpu_s_per_step_median": medians,
                    "close_path_per_step": close_path,
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
