"""Confirmation bookkeeping: which of a gateway's batches the pipelines have applied.

A pipeline confirms a seq once every one of its partitions has confirmed a seq at least as
high; the gateway counts a batch as confirmed once ``confirm_from`` is satisfied (every
named pipeline, or any one pipeline when none is named). Pure; no broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.schemas.control import Confirm


@dataclass(slots=True)
class _Pipeline:
    partitions: int
    partitions_at_ms: int
    seqs: dict[int, int] = field(default_factory=dict)
    missing: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def confirmed(self) -> int:
        return min(self.seqs.get(p, -1) for p in range(self.partitions))


class ConfirmTracker:
    """Folds ``Confirm`` messages into the highest seq the gateway may drop from its spool.

    Args:
        gateway_id: whose confirmations to accept (others are ignored).
        confirm_from: the pipelines that must confirm; empty: any one pipeline.
    """

    def __init__(self, gateway_id: str, confirm_from: tuple[str, ...] = ()) -> None:
        self.gateway_id = gateway_id
        self.confirm_from = confirm_from
        self._pipelines: dict[str, _Pipeline] = {}

    def update(self, confirm: Confirm) -> bool:
        """Record one confirmation; True if the gateway's confirmed seq may have moved."""
        if confirm.gateway_id != self.gateway_id:
            return False
        if self.confirm_from and confirm.pipeline not in self.confirm_from:
            return False
        pipeline = self._pipelines.get(confirm.pipeline)
        if pipeline is None:
            pipeline = self._pipelines[confirm.pipeline] = _Pipeline(
                confirm.partitions, confirm.at_ms
            )
        elif confirm.at_ms >= pipeline.partitions_at_ms:
            # Retained confirms of partitions that no longer exist stay on the broker; the
            # newest message says how many partitions the pipeline has now.
            pipeline.partitions = confirm.partitions
            pipeline.partitions_at_ms = confirm.at_ms
        # A partition never takes back a confirmation (a combiner restored from an older
        # checkpoint may announce less; the gateway has already dropped those batches).
        previous = pipeline.seqs.get(confirm.partition, -1)
        pipeline.seqs[confirm.partition] = max(previous, confirm.seq)
        gap_before = pipeline.missing.get(confirm.partition, ())
        pipeline.missing[confirm.partition] = confirm.missing
        return confirm.seq > previous or confirm.missing != gap_before

    def missing(self) -> frozenset[int]:
        """Seqs above the confirmed one that some partition reports missing (re-send hints).

        Only from the pipelines whose confirmation counts (``confirm_from``, or all).
        """
        seqs: set[int] = set()
        for name, pipeline in self._pipelines.items():
            if self.confirm_from and name not in self.confirm_from:
                continue
            for gap in pipeline.missing.values():
                seqs.update(gap)
        confirmed = self.confirmed_seq()
        return frozenset(s for s in seqs if s > confirmed)

    def pipeline_seq(self, pipeline: str) -> int:
        """The highest seq every partition of ``pipeline`` confirmed (-1: none)."""
        state = self._pipelines.get(pipeline)
        return -1 if state is None else state.confirmed()

    def confirmed_seq(self) -> int:
        """The highest seq confirmed as ``confirm_from`` requires (-1: none)."""
        if self.confirm_from:
            return min(self.pipeline_seq(p) for p in self.confirm_from)
        return max((p.confirmed() for p in self._pipelines.values()), default=-1)
