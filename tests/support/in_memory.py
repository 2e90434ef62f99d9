"""Run workers' and combiners' pure cores without a broker: shuffled, duplicated deliveries."""

from __future__ import annotations

import numpy as np
import polars as pl

from shoal.clock import FakeClock
from shoal.processors.combine import Combiner, LateRows
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import ClosedWindows
from shoal.schemas.control import GatewayStatus
from shoal.schemas.results import latest_revisions
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.datasets import GeneratedBatch, all_rows
from tests.support.oracle import closed_by, expected_results, without_pending_sessions


def statuses_for(batches: list[GeneratedBatch], at_ms: int) -> list[GatewayStatus]:
    """The status each gateway would announce once it has published everything."""
    by_gateway: dict[str, list[int]] = {}
    for batch in batches:
        by_gateway.setdefault(batch.gateway_id, []).append(batch.seq)
    return [
        GatewayStatus(
            gateway_id=g,
            stream="s",
            next_seq=max(seqs) + 1,
            first_unconfirmed_seq=min(seqs),
            unconfirmed_batches=len(seqs),
            unconfirmed_rows=0,
            oldest_unconfirmed_ms=None,
            spool_bytes=0,
            rows_total=0,
            at_ms=at_ms,
        )
        for g, seqs in by_gateway.items()
    ]


def run_in_memory(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    *,
    seed: int,
    duplicate_fraction: float = 0.2,
    workers: int = 3,
    announce: bool = True,
    reorder_within: int | None = None,
    advance_ms: int = 1,
) -> tuple[pl.DataFrame, list[LateRows], list[Combiner]]:
    """Deliver every batch (some twice) in a shuffled order through N builders and P combiners.

    The clock moves ``advance_ms`` after each delivery (count windows close at most once per
    ``combine.COUNT_CLOSE_INTERVAL_MS`` of it).

    Returns the emitted results (all partitions; each window's latest revision, see
    ``latest_of``), the late rows reported, and the combiners. Partials travel through their
    wire encoding, as they would over MQTT.
    """
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    builders = [PartialBuilder(spec, f"w{i}") for i in range(workers)]
    combiners = [Combiner(spec, p, clock) for p in range(spec.partitions)]
    order = list(range(len(batches)))
    if reorder_within is None:
        order += [i for i in order if rng.random() < duplicate_fraction]
        rng.shuffle(order)
    else:
        order = nearly_in_order(batches, rng, reorder_within, duplicate_fraction)
    emitted: list[pl.DataFrame] = []
    late: list[LateRows] = []
    if announce:
        for status in statuses_for(batches, clock.now_ms()):
            for combiner in combiners:
                combiner.receive_status(status)
    for i, index in enumerate(order):
        batch = batches[index]
        builder = builders[i % workers]
        info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, builder.worker_id)
        for partial in builder.build(batch.frame, info, clock.now_ms()):
            received = Partial.decode(partial.encode())
            step = combiners[received.partition].receive(received)
            late.extend(step.late)
            closed = combiners[received.partition].tick().closed
            if closed is not None and not closed.empty:
                emitted.append(with_revisions(closed, received.partition))
        clock.advance(advance_ms)
    clock.advance(spec.idle_timeout_ms + 1)
    for combiner in combiners:
        step = combiner.tick()
        late.extend(step.late)
        if step.closed is not None and not step.closed.empty:
            emitted.append(with_revisions(step.closed, combiner.partition))
    if not emitted:
        return combiners[0].state.empty_result(), late, combiners
    return latest_of(pl.concat(emitted, how="diagonal_relaxed")), late, combiners


def shuffled_with_duplicates(count: int, rng: np.random.Generator, fraction: float) -> list[int]:
    """Delivery order of ``count`` batches: all shuffled (across and within gateways), then
    about ``fraction`` of them again (duplicated, as re-sent)."""
    order = list(range(count))
    rng.shuffle(order)
    return order + [i for i in range(count) if rng.random() < fraction]


def nearly_in_order(
    batches: list[GeneratedBatch],
    rng: np.random.Generator,
    within: int,
    duplicate_fraction: float,
) -> list[int]:
    """Gateways interleaved by seq, shuffled within runs of ``within`` deliveries, with
    duplicates a little later: windows close while data still flows, so late rows can
    reach windows already closed."""
    order = sorted(range(len(batches)), key=lambda i: (batches[i].seq, batches[i].gateway_id))
    for lo in range(0, len(order), within):
        chunk = order[lo : lo + within]
        rng.shuffle(chunk)
        order[lo : lo + within] = chunk
    out = list(order)
    for position, index in enumerate(order):
        if rng.random() < duplicate_fraction:
            out.insert(min(len(out), position + int(rng.integers(1, 2 * within + 1))), index)
    return out


def with_revisions(closed: ClosedWindows, partition: int) -> pl.DataFrame:
    """A closed-windows frame with its ``partition`` and each window's ``revision``."""
    revisions = pl.DataFrame(
        {
            "window": [w for w, _ in closed.revisions],
            "start": [s for _, s in closed.revisions],
            "revision": list(closed.revisions.values()),
        },
        schema={"window": pl.String, "start": pl.Int64, "revision": pl.Int64},
    )
    return closed.frame.join(revisions, on=["window", "start"], how="left").with_columns(
        pl.col("revision").fill_null(1), partition=pl.lit(partition, dtype=pl.Int64)
    )


def latest_of(emitted: pl.DataFrame) -> pl.DataFrame:
    """Each (window, start, key)'s latest revision, without the revision columns."""
    return latest_revisions(emitted.with_columns(pipeline=pl.lit("t"))).drop(
        "pipeline", "partition", "revision"
    )


def check_against_oracle(
    spec: PipelineSpec,
    batches: list[GeneratedBatch],
    seed: int,
    workers: int = 3,
    duplicate_fraction: float = 0.3,
    reorder_within: int | None = None,
) -> list[Combiner]:
    """``run_in_memory``, then: what each partition closed is the oracle's, late counts exact."""
    emitted, late, combiners = run_in_memory(
        spec,
        batches,
        seed=seed,
        workers=workers,
        duplicate_fraction=duplicate_fraction,
        reorder_within=reorder_within,
    )
    rows = all_rows(batches)
    every, late_count = expected_results(rows, spec)
    # Only windows a partition's final close threshold has passed can be closed there (no
    # threshold: no gateway ever delivered a row, so nothing can have closed).
    thresholds = [c.closed_through for c in combiners]
    expected = closed_by(every, spec, thresholds)
    emitted = without_pending_sessions(emitted, every, spec, thresholds)
    assert_matches_oracle(emitted, expected, spec, scale_of(rows, spec))
    assert sum(item.rows for item in late) == late_count
    assert sum(c.counters.rows_late for c in combiners) == late_count
    return combiners
