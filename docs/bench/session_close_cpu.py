"""CPU seconds per close of a session combiner at 100,000 keys, in the low-rate regime, two trees.

``.venv/bin/python docs/bench/session_close_cpu.py BASE_SRC [REPEATS]`` makes scenario B's
partials once (10 gateways of 10,000 sensors at 0.5/s, the default pipeline with the
``session-1200ms`` preset, 5,000-row batches, so a round is the 1 s after which the benchmark's
gateways seal by age; cached as ``sessclose-partials-*`` in the temporary folder). At 0.5/s a
sensor's rows lie 2 s apart, beyond the 1.2-s gap: every row is a session of its own, as in the
steps where ``shoal bench pipeline --max --window session`` at 100,000 keys achieved only half
of what was offered (docs/benchmarks.md). It then drives a ``Combiner`` core with them, in a
fresh process per repeat, alternating between ``BASE_SRC`` (a checkout's ``src``, e.g.
``main``'s) and this tree's ``src``: after every partial a ``close_ready``, as the runtime does
after each message. Each process times, in CPU seconds (``time.process_time``, outermost call
only): ``close`` (``SessionState.close``, its merge of the pieces into the sessions included),
``add`` (``SessionState.add``), and ``combiner`` (``receive`` + ``close_ready`` + ``tick``,
partials already decoded). Prints per tree the median of the repeats per step (steps: closes
that published rows) and a digest of every published frame (equal digests: identical results).
Figures: docs/benchmarks.md, "Session windows at 100,000 keys, session 11".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from _close_harness import Scenario, main, timed

from shoal.processors.session_state import SessionState

SCENARIO = Scenario("sessclose", "session", sensors=10_000, rate_hz=0.5, seconds=30, batch=5_000)
PARTS = ("close", "add", "combiner")
HERE = Path(__file__).resolve()


def run_once() -> dict[str, Any]:
    """One pass of the combiner over the cached partials: CPU seconds by part, a digest."""
    totals = dict.fromkeys(PARTS, 0.0)
    timed(SessionState, "close", totals, "close")
    timed(SessionState, "add", totals, "add")
    digest, steps, results = hashlib.sha256(), 0, 0
    frames = []
    for closed in SCENARIO.closed_frames(totals, close_each=True):
        steps += 1
        results += closed.height
        frames.append(closed)
    for frame in frames:
        ordered = frame.sort("window", "start", "key")
        digest.update(ordered.hash_rows(seed=0).to_numpy().tobytes())  # values, not layout
    per_step = {k: v / max(steps, 1) for k, v in totals.items()}
    return {"steps": steps, "results": results, "digest": digest.hexdigest()[:16], **per_step}


if __name__ == "__main__":
    main(HERE, SCENARIO, run_once, PARTS)
