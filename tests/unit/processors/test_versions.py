"""An update switches at a window boundary: each version's results are the oracle's.

Pure cores, no broker: partials of both versions, shuffled and duplicated; some batches are
computed only with the old spec (a worker that has not learnt of the update yet); those the
new version needs stay unconfirmed and are sent again, as a gateway does, computed with both.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from shoal.clock import FakeClock
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.versions import Chain, Stage, grid_ms, restrict, switch_point
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import GeneratedBatch, all_rows, make_batches, make_spec
from tests.support.in_memory import statuses_for
from tests.support.oracle import expected_results

V1 = make_spec("t", [{"kind": "tumbling", "size_ms": 2_000}], ["count", "sum", "max"], 2)
V2 = make_spec(
    "t",
    [{"kind": "hopping", "size_ms": 4_000, "slide_ms": 1_000}],
    ["count", "min", "mean"],
    2,
)


def test_the_cut_is_the_next_boundary_of_both_grids() -> None:
    assert grid_ms([V1, V2]) == 4_000
    assert switch_point(7_999, 4_000) == 8_000
    assert switch_point(8_000, 4_000) == 12_000  # strictly after: 8 000 may hold applied rows


def _partials(builder: PartialBuilder, batch: GeneratedBatch) -> list[Partial]:
    info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, builder.worker_id)
    return [Partial.decode(p.encode()) for p in builder.build(batch.frame, info, 0)]


def _run(seed: int, update_after: int) -> tuple[list[Chain], dict[int | None, pl.DataFrame]]:
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    batches = make_batches(seed=seed, gateways=3, batches_per_gateway=20, late_fraction=0.05)
    old, new = PartialBuilder(V1, "w0"), PartialBuilder(V2, "w1")
    chains = [Chain(Stage(1, Combiner(V1, p, clock))) for p in range(V1.partitions)]
    emitted: dict[int | None, list[pl.DataFrame]] = {1: [], 2: []}

    def collect(results: list) -> None:
        for stage, closed in results:
            if closed is not None and not closed.empty:
                emitted[stage.version].append(closed.frame)

    def deliver(partials: list[Partial]) -> None:
        for partial in partials:
            chain = chains[partial.partition]
            collect([(s, step.closed) for s, step in chain.receive(partial)])
            collect(chain.close_ready(clock.now_ms()))
            collect([(s, step.closed) for s, step in chain.tick()])
            collect(chain.retire())

    for chain in chains:
        for status in statuses_for(batches, 0):
            chain.receive_status(status)
    order = sorted(range(len(batches)), key=lambda i: (batches[i].seq, batches[i].gateway_id))
    unaware: list[int] = []
    for position, index in enumerate(order):
        if position == update_after:
            for chain in chains:
                chain.update(2, V2, clock, not_before_ms=0)
        batch = batches[index]
        partials = _partials(old, batch)
        if position >= update_after:
            if rng.random() < 0.3:
                unaware.append(index)  # computed with the old spec only
            else:
                partials += _partials(new, batch)
        rng.shuffle(partials)  # type: ignore[arg-type]
        deliver(partials + partials[: int(rng.integers(0, 3))])
        clock.advance(1)
    for index in unaware:  # re-sent: computed with both versions now
        deliver(_partials(new, batches[index]) + _partials(old, batches[index]))
    clock.advance(V1.idle_timeout_ms + 1)
    for chain in chains:
        collect([(s, step.closed) for s, step in chain.tick()])
        collect(chain.retire())
    frames = {v: pl.concat(f) if f else pl.DataFrame() for v, f in emitted.items()}
    return chains, frames


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_each_version_computes_exactly_the_windows_on_its_side_of_the_cut(seed: int) -> None:
    chains, emitted = _run(seed, update_after=25)
    cuts = {c.stages[-1].from_ms for c in chains} | {s.from_ms for c in chains for s in c.retired}
    cuts.discard(None)
    assert len(cuts) == 1, cuts  # every partition picked the same cut
    (cut,) = cuts
    rows = all_rows(make_batches(seed=seed, gateways=3, batches_per_gateway=20, late_fraction=0.05))
    for version, spec, side in ((1, V1, pl.col("start") < cut), (2, V2, pl.col("start") >= cut)):
        expected, _ = expected_results(rows, spec)
        threshold = min(c.stages[-1].core.closed_through or 0 for c in chains)
        expected = expected.filter(side & (pl.col("end") <= threshold))
        got = emitted[version].filter(pl.col("end") <= threshold)
        assert expected.height > 0
        assert_matches_oracle(got, expected, spec, scale_of(rows, spec))
    # The old version ended once its windows closed; only the new one remains.
    assert all(c.versions == (2,) for c in chains)
    assert all(len(c.retired) == 1 for c in chains)


def test_confirmation_waits_for_every_version() -> None:
    clock = FakeClock()
    chain = Chain(Stage(1, Combiner(V1, 0, clock)))
    batches = make_batches(seed=4, gateways=1, batches_per_gateway=6, late_fraction=0.0)
    for status in statuses_for(batches, 0):
        chain.receive_status(status)
    old, new = PartialBuilder(V1, "w0"), PartialBuilder(V2, "w1")
    for batch in batches[:3]:
        for p in _partials(old, batch):
            if p.partition == 0:
                chain.receive(p)
    cut = chain.update(2, V2, clock, not_before_ms=0).from_ms
    assert cut is not None
    later = next(b for b in batches[3:] if int(b.frame["ts"].max()) >= cut)  # type: ignore[arg-type]
    for batch in batches[3 : later.seq]:  # wholly before the cut: no v2 partial needed
        for p in _partials(old, batch):
            if p.partition == 0:
                chain.receive(p)
    for p in _partials(old, later):  # computed by a worker unaware of v2
        if p.partition == 0:
            chain.receive(p)
    assert chain.stages[0].core.confirmable() == {"gw0": later.seq}
    # v2 still needs the batch that crosses the cut: unconfirmed, its gateway sends it again
    assert chain.confirmable() == {"gw0": later.seq - 1}
    for p in _partials(new, later):
        if p.partition == 0:
            chain.receive(p)
    assert chain.confirmable() == {"gw0": later.seq}


def test_restrict_keeps_the_windows_of_a_range() -> None:
    batch = make_batches(seed=5, gateways=1, batches_per_gateway=1, rows_per_batch=(40, 40))[0]
    builder = PartialBuilder(make_spec("t", [{"size_ms": 100}], ["count"]), "w")
    (partial, *_) = _partials(builder, batch)
    assert partial.rows is not None
    middle = int(np.median(partial.rows.start))
    low, high = restrict(partial, None, middle), restrict(partial, middle, None)
    assert low.rows is not None
    assert high.rows is not None
    assert len(low.rows) + len(high.rows) == len(partial.rows)
    assert int(low.rows.start.max()) < middle <= int(high.rows.start.min())
