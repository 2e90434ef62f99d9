"""Delivering partials to a combiner core as the runtime does, with its close log kept.

``Deliveries`` feeds one-row batches to a combiner (``Harness.partial``), ticks after each,
appends what the core decided to a close-log buffer (as ``CombinerRuntime`` writes
``combiner.closes``) and records every window message published, by (start, revision), with
its content: a test can then restore another core from a checkpoint and that log, re-send
batches in another order and see whether one revision ever had two contents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import polars as pl

from shoal.processors.combine import Combiner
from shoal.processors.partials import Partial
from shoal.processors.results import split_windows
from shoal.processors.state import ClosedWindows

Content = tuple[tuple[object, ...], ...]


@dataclass
class Deliveries:
    """What a run delivered and published (see the module docstring).

    ``partial``: builds gateway ``g``'s batch ``seq`` of rows ``(key, ts, value)``.
    ``columns``: the result columns a message's content is compared on.
    """

    partial: Callable[[str, int, list[tuple[str, int, float]]], Partial]
    columns: tuple[str, ...] = ("key", "count")
    log: bytearray = field(default_factory=bytearray)
    copies: dict[tuple[int, int], set[Content]] = field(default_factory=dict)
    messages: list[pl.DataFrame] = field(default_factory=list)
    """Every message's result rows with ``start`` and ``revision`` (for a consumer's view)."""

    def persist(self, combiner: Combiner) -> None:
        """Append (or rewrite, after a checkpoint) the close log, as the runtime does."""
        write = combiner.take_log()
        if write is not None:
            self.log[:] = write.data if write.replace else bytes(self.log) + write.data

    def publish(self, closed: ClosedWindows | None) -> None:
        """Record the window messages of ``closed``."""
        if closed is None or closed.empty:
            return
        for result in split_windows(closed.frame, closed.revisions, closed.sessions):
            content = tuple(sorted(result.frame.select(*self.columns).rows()))
            self.copies.setdefault((result.start, result.revision), set()).add(content)
        self.messages.extend(message_rows(closed))

    def deliver(self, combiner: Combiner, gateway_id: str, seq: int, row: tuple[str, int]) -> None:
        """One batch of one row (value 1.0), then a tick; log and record what came out."""
        key, ts = row
        step = combiner.receive(self.partial(gateway_id, seq, [(key, ts, 1.0)]))
        for closed in step.replayed:
            self.publish(closed)
        tick = combiner.tick()
        self.persist(combiner)
        self.publish(tick.closed)

    def conflicting(self) -> list[tuple[int, int]]:
        """(start, revision) published with more than one content."""
        return sorted(k for k, seen in self.copies.items() if len(seen) > 1)


def message_rows(closed: ClosedWindows) -> list[pl.DataFrame]:
    """Each window message of ``closed`` as a consumer sees its result rows: with pipeline
    ``t``, ``window``, ``start``, partition 0 and ``revision`` (for ``latest_revisions``)."""
    return [
        result.frame.with_columns(
            pipeline=pl.lit("t"),
            window=pl.lit(result.window),
            start=pl.lit(result.start),
            partition=pl.lit(0),
            revision=pl.lit(result.revision),
        )
        for result in split_windows(closed.frame, closed.revisions, closed.sessions)
    ]
