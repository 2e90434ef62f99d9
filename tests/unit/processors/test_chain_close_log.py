"""A chain of spec versions keeps a close log per stage: a restored chain re-takes both.

The timing-dependent case of corrections (test_corrections.py) in both stages of a chain
opened by an update: gateways b and c go quiet, a closes a window of each version without
them, their next rows are corrections; the partition then dies after its checkpoint (taken
before the close) and the gateways re-send in another order. Every (version, window,
revision) must be published with one content, as before the crash; without the logs the
restored chain publishes revision 1 of both windows with other rows.
"""

from __future__ import annotations

from shoal.clock import FakeClock
from shoal.control.canonical import canonical_mapping, canonicalize
from shoal.processors.combine import Combiner, Step
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.results import split_windows
from shoal.processors.state import ClosedWindows
from shoal.processors.versions import Chain, Stage
from tests.support.datasets import frame_of
from tests.unit.processors.test_combiner import IDLE, make_spec, status

V1 = make_spec(allowed_lateness_ms=3_000)
V2 = make_spec(
    windows=[{"kind": "tumbling", "size_ms": 2_000}],
    aggregates=["count"],
    allowed_lateness_ms=3_000,
)
Rows = list[tuple[str, int]]
Copies = dict[tuple[int | None, int, int], set[tuple[tuple[str, int], ...]]]


class Partition:
    """One partition's chain fed with both versions' partials, its logs kept as files are."""

    def __init__(self, chain: Chain, copies: Copies, logs: dict[int | None, bytearray]) -> None:
        self.chain, self.copies, self.logs = chain, copies, logs
        self.builders = {1: PartialBuilder(V1, "w1"), 2: PartialBuilder(V2, "w2")}

    def persist(self) -> None:
        for stage in self.chain.stages:
            write = stage.core.take_log()
            if write is not None:
                log = self.logs.setdefault(stage.version, bytearray())
                log[:] = write.data if write.replace else bytes(log) + write.data

    def publish(self, stage: Stage, closed: ClosedWindows | None) -> None:
        if closed is None or closed.empty:
            return
        for result in split_windows(closed.frame, closed.revisions):
            content = tuple(sorted(result.frame.select("key", "count").rows()))
            self.copies.setdefault((stage.version, result.start, result.revision), set()).add(
                content
            )

    def publish_steps(self, steps: list[tuple[Stage, Step]]) -> None:
        for stage, step in steps:
            for closed in step.replayed:
                self.publish(stage, closed)
            self.publish(stage, step.closed)

    def deliver(self, gateway_id: str, seq: int, rows: Rows) -> None:
        """A batch's partials of every open version, then a tick, as the runtime does."""
        batch = BatchInfo(gateway_id, seq, "s", 0, None, None, 0, 0, "w")
        frame = frame_of([(key, ts, 1.0) for key, ts in rows])
        for version in self.chain.versions:
            (partial,) = self.builders[version].build(frame, batch, 0)
            self.publish_steps(self.chain.receive(partial))
        closes = self.chain.close_ready(self.chain.current.core.clock.now_ms())
        steps = self.chain.tick()
        self.persist()  # before publishing, as the runtime does
        for stage, closed in closes:
            self.publish(stage, closed)
        self.publish_steps(steps)


def _crash_and_resend(*, with_logs: bool) -> Copies:
    clock = FakeClock()
    chain = Chain(Stage(1, Combiner(V1, 0, clock), spec_doc=canonical_mapping(V1)))
    copies: Copies = {}
    logs: dict[int | None, bytearray] = {}
    live = Partition(chain, copies, logs)
    for gateway_id, next_seq in (("a", 3), ("b", 1), ("c", 1)):
        chain.receive_status(status(gateway_id, 0, next_seq))
    live.deliver("a", 0, [("k", 5_100)])
    live.deliver("b", 0, [("k", 5_200)])
    live.deliver("c", 0, [("j", 5_300)])
    stage = chain.update(2, V2, clock, not_before_ms=0, spec_doc=canonical_mapping(V2))
    assert stage.from_ms == 6_000  # v1 owns [5_000, 6_000), v2 [6_000, 8_000)
    live.deliver("a", 1, [("k", 6_100)])
    checkpoint = chain.snapshot()
    live.persist()
    for s in chain.stages:  # the checkpoint is durable: the logs keep what follows it
        s.core.close_log.settle(s.core.close_log.generation)
    live.persist()
    clock.advance(IDLE + 1)  # b and c go quiet
    live.deliver("a", 2, [("k", 9_000)])  # threshold 8_500: both windows close without them
    live.deliver("b", 1, [("k", 5_400), ("k", 6_200)])  # on time for b: corrections
    live.deliver("c", 1, [("j", 5_500), ("j", 6_300)])
    assert {key for key in copies if key[2] > 1} == {(1, 5_000, 2), (1, 5_000, 3)} | {
        (2, 6_000, 2),
        (2, 6_000, 3),
    }

    restored = Chain.restore(
        checkpoint,
        0,
        clock,
        lambda mapping: canonicalize(mapping).spec,
        logs=(lambda version: bytes(logs[version])) if with_logs else None,
    )
    assert restored is not None
    assert restored.replaying == with_logs
    again = Partition(restored, copies, {})
    again.deliver("c", 1, [("j", 5_500), ("j", 6_300)])  # re-sent in another order
    again.deliver("b", 1, [("k", 5_400), ("k", 6_200)])
    again.deliver("a", 2, [("k", 9_000)])
    again.deliver("b", 2, [("k", 5_600), ("k", 6_400)])  # new after the crash
    clock.advance(IDLE + 1)
    again.publish_steps(restored.tick())
    assert not restored.replaying
    return copies


def test_a_restored_chain_re_takes_every_stage_s_logged_closes() -> None:
    copies = _crash_and_resend(with_logs=True)
    assert {k: len(v) for k, v in copies.items() if len(v) > 1} == {}
    # b's row sent after the crash reached both windows (revision 4 of each)
    latest = {
        version: max((r, c) for (v, _, r), seen in copies.items() if v == version for c in seen)
        for version in (1, 2)
    }
    assert latest[1] == (4, (("j", 2), ("k", 4)))
    assert latest[2] == (4, (("j", 1), ("k", 3)))


def test_without_the_logs_the_restored_chain_publishes_conflicting_copies() -> None:
    copies = _crash_and_resend(with_logs=False)
    conflicting = sorted((v, s, r) for (v, s, r), seen in copies.items() if len(seen) > 1)
    assert conflicting == [(1, 5_000, 1), (2, 6_000, 1)]
