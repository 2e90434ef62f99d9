"""CPU per partial a combiner takes into its state (``WindowState.add``), at scenario B, two trees.

``.venv/bin/python docs/bench/combiner_add_cpu.py BASE_SRC [REPEATS]`` makes scenario B's
partials once (10 gateways of 1,000 sensors at 25/s, the default pipeline's 10-s tumbling
window, 16,000-row batches: each partial 1,000 state rows and about 4,700 sketch cells;
cached as ``combadd-partials-*`` in the temporary folder), then drives a ``Combiner`` core
with them (``_close_harness``), in a fresh process per repeat, alternating between
``BASE_SRC`` (a checkout's ``src``) and this tree's. Each process times, in CPU seconds
(``time.process_time``), ``add`` (``WindowState.add``) and ``combiner`` (``receive`` +
``tick``, partials already decoded), per partial; prints per tree the medians and a digest
of every closed window's rows (equal digests: identical results). Figures:
docs/benchmarks.md, "The combiner takes a partial as it comes".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from _close_harness import GATEWAYS, Scenario, main, timed

from shoal.processors.state import WindowState

SCENARIO = Scenario("combadd", "tumbling", sensors=1_000, rate_hz=25.0, seconds=21)
PARTS = ("add", "combiner")
HERE = Path(__file__).resolve()


def run_once() -> dict[str, Any]:
    """One pass of the combiner over the cached partials: CPU seconds per partial, a digest."""
    totals = dict.fromkeys(PARTS, 0.0)
    timed(WindowState, "add", totals, "add")
    digest, results = hashlib.sha256(), 0
    for closed in SCENARIO.closed_frames(totals):
        frame = closed.sort("window", "key")
        digest.update(frame.hash_rows(seed=0).to_numpy().tobytes())  # values, not layout
        results += frame.height
    partials = GATEWAYS * len(SCENARIO.load()[1])  # one partial per gateway and round
    per_partial = {k: v / partials for k, v in totals.items()}
    return {"steps": partials, "results": results, "digest": digest.hexdigest()[:16], **per_partial}


if __name__ == "__main__":
    main(HERE, SCENARIO, run_once, PARTS)
