"""Run workers' and combiners' pure cores without a broker: shuffled, duplicated deliveries."""

from __future__ import annotations

import numpy as np
import polars as pl

from shoal.clock import FakeClock
from shoal.processors.combine import Combiner, LateRows
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.schemas.control import GatewayStatus
from tests.support.datasets import GeneratedBatch


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
) -> tuple[pl.DataFrame, list[LateRows], list[Combiner]]:
    """Deliver every batch (some twice) in a shuffled order through N builders and P combiners.

    Returns the emitted results (all partitions), the late rows reported, and the combiners.
    Partials travel through their wire encoding, as they would over MQTT.
    """
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    builders = [PartialBuilder(spec, f"w{i}") for i in range(workers)]
    combiners = [Combiner(spec, p, clock) for p in range(spec.partitions)]
    order = list(range(len(batches)))
    order += [i for i in order if rng.random() < duplicate_fraction]
    rng.shuffle(order)
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
                emitted.append(closed.frame)
        clock.advance(1)
    clock.advance(spec.idle_timeout_ms + 1)
    for combiner in combiners:
        step = combiner.tick()
        late.extend(step.late)
        if step.closed is not None and not step.closed.empty:
            emitted.append(step.closed.frame)
    frame = pl.concat(emitted) if emitted else combiners[0].state.empty_result()
    return frame, late, combiners
