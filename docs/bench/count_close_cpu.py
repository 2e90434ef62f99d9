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
Figures: docs/benchmarks.md, "Count windows at 10,000 keys, session 10: the close step, then
the bar".
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _close_harness import Scenario, main, timed

from shoal.processors.count import CountState

SCENARIO = Scenario("cntclose", "count", sensors=1_000, rate_hz=250, seconds=8)
PARTS = ("order", "fill", "finalise", "combiner")
HERE = Path(__file__).resolve()


def run_once() -> dict[str, Any]:
    """One pass of the combiner over the cached partials: CPU seconds by part, a digest."""
    totals = dict.fromkeys(PARTS, 0.0)
    timed(CountState, "_in_event_order", totals, "order")
    timed(CountState, "_fill", totals, "fill")
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
    digest, results = hashlib.sha256(), 0
    for closed in SCENARIO.closed_frames(totals):
        frame = closed.sort("window", "key", "index")
        digest.update(frame.hash_rows(seed=0).to_numpy().tobytes())  # values, not layout
        results += frame.height
    totals["finalise"] = finalise["cpu_s"]
    steps = int(finalise["calls"])
    per_step = {k: v / max(steps, 1) for k, v in totals.items()}
    return {"steps": steps, "results": results, "digest": digest.hexdigest()[:16], **per_step}


if __name__ == "__main__":
    main(HERE, SCENARIO, run_once, PARTS)
