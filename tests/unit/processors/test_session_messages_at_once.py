"""A close's session messages encoded at once equal those encoded one by one.

``split_windows`` cuts a close's messages as slices of runs, ``session_lines`` encodes the
rows of every session message in one pass, ``session_keys`` gives every per-key message of
the sessions in one result: each must give the same bytes as the message-by-message path
(``group_by``, ``ndjson_rows``, ``key_payloads`` per message) it replaces.
"""

from __future__ import annotations

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from shoal.clock import FakeClock
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.results import (
    FIRST_REVISION,
    WindowResult,
    key_payloads,
    ndjson_rows,
    session_keys,
    session_lines,
    split_windows,
    window_runs,
)
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.state import ClosedWindows
from tests.support.datasets import make_batches
from tests.support.in_memory import statuses_for


def _spec(with_tumbling: bool) -> PipelineSpec:
    session = {"kind": "session", "gap_ms": 400, "max_duration_ms": 5_000}
    tumbling = [{"kind": "tumbling", "size_ms": 2_000}] if with_tumbling else []
    return parse_pipeline(
        {
            "name": "t",
            "windows": [session, *tumbling],
            "aggregates": ["count", "mean", "min", "max", "p50"],
            "lateness_ms": 0,
            "idle_timeout_ms": 1_000,
        }
    )


def _closes(spec: PipelineSpec, seed: int) -> list[ClosedWindows]:
    """Every non-empty close of one combiner fed batches in seq order."""
    clock = FakeClock()
    builder = PartialBuilder(spec, "w0")
    combiner = Combiner(spec, 0, clock)
    batches = make_batches(seed=seed, gateways=3, batches_per_gateway=20, keys=25, step_ms=300)
    for status in statuses_for(batches, clock.now_ms()):
        combiner.receive_status(status)
    closes = []
    for batch in sorted(batches, key=lambda b: (b.seq, b.gateway_id)):
        info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, "w0")
        for partial in builder.build(batch.frame, info, clock.now_ms()):
            combiner.receive(Partial.decode(partial.encode()))
        closed = combiner.tick().closed
        if closed is not None and not closed.empty:
            closes.append(closed)
        clock.advance(1)
    closes.append(combiner.flush())
    return closes


def _one_by_one(closed: ClosedWindows) -> list[WindowResult]:
    """``split_windows`` as it was: a ``group_by``, a frame per message."""
    out = []
    for (window, start), part in closed.frame.group_by("window", "start", maintain_order=True):
        name = str(window)
        if name in closed.sessions:
            end = int(part["end"].max())  # type: ignore[arg-type]
            frame = part.drop("window", "start").select("key", "end", pl.exclude("key", "end"))
        else:
            end, frame = int(part["end"][0]), part.drop("window", "start", "end")
        out.append(WindowResult(name, int(start), end, frame, FIRST_REVISION))  # type: ignore[arg-type]
    out.sort(key=lambda r: (r.end, r.window))
    return out


@pytest.mark.parametrize("with_tumbling", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_split_session_lines_and_keys_equal_the_message_by_message_path(
    with_tumbling: bool, seed: int
) -> None:
    many = 0
    for closed in _closes(_spec(with_tumbling), seed):
        results = split_windows(closed.frame, closed.revisions, closed.sessions)
        expected = _one_by_one(closed)
        assert [(r.window, r.start, r.end) for r in results] == [
            (r.window, r.start, r.end) for r in expected
        ]
        for got, want in zip(results, expected, strict=True):
            assert_frame_equal(got.frame, want.frame)
        lines = session_lines(closed.frame, closed.sessions)
        sessions = [r for r in expected if r.window in closed.sessions]
        if len(sessions) >= 2:
            many += 1
            assert lines == {(r.window, r.start): ndjson_rows(r) for r in sessions}
        together = session_keys(closed.frame, closed.sessions)
        if not sessions:
            assert together is None
            continue
        assert together is not None
        head, pairs = key_payloads(together, "p", 123)
        assert head == b""
        by_start = sorted(sessions, key=lambda r: r.start)  # one window: runs in start order
        want_pairs = [
            (key, h + rest)
            for r in by_start
            for h, rests in [key_payloads(r, "p", 123)]
            for key, rest in rests
        ]
        assert pairs == want_pairs
    assert many > 0  # closes of several session messages were compared


def test_runs_are_refused_when_a_message_is_not_one_run() -> None:
    frame = pl.DataFrame({"window": ["s", "s", "t", "s"], "start": [1, 1, 1, 1]})
    assert window_runs(frame) is None
    assert window_runs(frame.head(3)) == [("s", 1, 0, 2), ("t", 1, 2, 3)]
