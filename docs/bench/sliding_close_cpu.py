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
from pathlib import Path
from typing import Any

from _close_harness import Scenario, main, timed

from shoal.processors.state import PaneState, WindowState

SCENARIO = Scenario("slclose", "sliding", sensors=10_000, rate_hz=2.3, seconds=20)
PARTS = ("assemble", "compact", "take_panes", "combiner")
HERE = Path(__file__).resolve()


def run_once() -> dict[str, Any]:
    """One pass of the combiner over the cached partials: CPU seconds by part, a digest."""
    totals = dict.fromkeys(PARTS, 0.0)
    timed(WindowState, "_finish_windows", totals, "assemble")  # prepare's, or close's
    timed(WindowState, "take_panes", totals, "take_panes")
    timed(PaneState, "compact", totals, "compact")  # inside ``assemble``: counted there
    digest, steps, results = hashlib.sha256(), 0, 0
    for closed in SCENARIO.closed_frames(totals):
        frame = closed.sort("window", "start", "key")
        digest.update(frame.hash_rows(seed=0).to_numpy().tobytes())  # values, not layout
        steps += frame.select("start").n_unique()
        results += frame.height
    per_step = {k: v / max(steps, 1) for k, v in totals.items()}
    return {"steps": steps, "results": results, "digest": digest.hexdigest()[:16], **per_step}


def _close_path(medians: dict[str, float]) -> dict[str, float]:
    return {
        "close_path_per_step": round(
            medians["assemble"] + medians["compact"] + medians["take_panes"], 4
        )
    }


if __name__ == "__main__":
    main(HERE, SCENARIO, run_once, PARTS, _close_path)
