"""Spec versions side by side in one combiner partition: an update switches at a window boundary.

Pure (no MQTT, no files). A partition of a pipeline deployed at run time holds a chain of
stages (``Stage``), one per spec version still open, oldest first. When a new version arrives, the
partition picks the *cut* ``S``: the first boundary of the two versions' common window grid
after everything it has applied so far (and after ``not_before_ms``, the update's own time,
so that partitions that are up to date agree on it). From then on:

* the old stage owns the windows that **start before** ``S`` (they finish under it, with every
  row they would have had: a hopping window starting before ``S`` still takes rows after it);
* the new stage owns the windows that start at or after ``S``;
* results say which version computed them (``Stage.version``).

Every stage sees every batch of every gateway (its own ``ProgressTracker``: exactly once,
in seq order): the partial of its own spec version, restricted to its windows
(``restrict``), or, when the batch has no row its windows can hold (``can_hold``), a
*progress-only* stand-in built from another version's partial for the same batch
(``progress_only``). A batch that a worker computed only with the old spec (it had not yet
learnt of the update) and that has rows for the new version is not applied by the new stage:
it stays unconfirmed (the partition confirms the minimum over its stages) and its gateway sends
it again, to a worker that computes both. So no row is lost and none counted twice, whatever
order workers learn of the update in.

A stage ends (``Chain.retire``) once its close threshold has passed every window it owns,
plus the allowed lateness, with no session open and every batch the newer stage applied
applied by it too; count windows left unfinished are flushed then (``rows < n``).

Close log (``shoal.processors.close_log``): each stage's core keeps its own, since each stage
closes on its own tracker and threshold; the runtime keeps one file per stage (named by its
version) and ``Chain.restore`` hands each restored core its file, so a restored chain
re-takes every stage's closes as the partition published them before it died. A stage does
not end while its closes are re-taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Final

import msgpack
import numpy as np

from shoal.clock import Clock
from shoal.errors import SchemaError
from shoal.processors.combine import Combiner, Step
from shoal.processors.partials import BatchInfo, Partial
from shoal.processors.progress import GatewayProgress, Spill
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import ClosedWindows
from shoal.schemas.control import GatewayStatus

CHAIN_VERSION: Final = 1
MAX_GRID_MS: Final = 24 * 3_600_000
"""A common grid coarser than a day falls back to the old version's own grid (the new
version's first windows may then start before the cut and hold only the rows after it)."""


def grid_ms(specs: Iterable[PipelineSpec]) -> int:
    """The least common multiple of every aligned window's size and slide (1: none)."""
    steps = [
        step
        for spec in specs
        for w in spec.windows
        if w.gap_ms is None and not w.by_count
        for step in (w.size_ms, w.slide_ms)
    ]
    return math.lcm(*steps) if steps else 1


def extent_ms(spec: PipelineSpec) -> int:
    """How far past its start's slide a window reaches (size - slide; 0: tumbling)."""
    return max(
        (w.size_ms - w.slide_ms for w in spec.windows if w.gap_ms is None and not w.by_count),
        default=0,
    )


def switch_point(after_ms: int, grid: int) -> int:
    """The first multiple of ``grid`` strictly after ``after_ms``."""
    return (after_ms // grid + 1) * grid


def can_hold(batch: BatchInfo, from_ms: int | None, until_ms: int | None, extent: int) -> bool:
    """Whether a batch may have rows for windows starting in ``[from_ms, until_ms)``.

    A window starting before ``until_ms`` holds rows up to ``until_ms + extent``; one starting
    at or after ``from_ms`` only rows at or after it. A batch without rows holds none.
    """
    if batch.status != "ok" or batch.min_ts is None or batch.max_ts is None:
        return False
    if from_ms is not None and batch.max_ts < from_ms:
        return False
    return until_ms is None or batch.min_ts < until_ms + extent


def restrict(partial: Partial, from_ms: int | None, until_ms: int | None) -> Partial:
    """``partial`` with only the state rows of windows starting in ``[from_ms, until_ms)``.

    Count windows' rows (``events``) are cut by their event time alike.
    """
    rows, events = partial.rows, partial.events
    if rows is not None and len(rows):
        keep = _inside(rows.start, from_ms, until_ms)
        if not keep.all():
            rows = rows.take(keep.nonzero()[0])
    if events is not None and len(events):
        keep = _inside(events.ts, from_ms, until_ms)
        if not keep.all():
            picked = keep.nonzero()[0]
            events = replace(
                events,
                key=events.key[picked],
                ts=events.ts[picked],
                row=events.row[picked],
                value=events.value[picked],
            )
    if rows is partial.rows and events is partial.events:
        return partial
    return replace(partial, rows=rows, events=events)


def _inside(values: Any, from_ms: int | None, until_ms: int | None) -> Any:
    keep = np.ones(len(values), dtype=np.bool_)
    if from_ms is not None:
        keep &= values >= from_ms
    if until_ms is not None:
        keep &= values < until_ms
    return keep


def progress_only(partial: Partial, fingerprint: str) -> Partial:
    """The same batch with no rows, for a stage of another spec version (``can_hold`` False)."""
    return replace(partial, fingerprint=fingerprint, rows=None, events=None)


@dataclass(slots=True)
class Stage:
    """One spec version in a partition's chain.

    Attributes:
        version: the spec version (None: a pipeline from a file, never updated).
        core: its merge/close core.
        from_ms: it owns windows starting at or after this (None: from the beginning).
        until_ms: ... and before this (None: open-ended, the current version).
        spec_doc: the spec's canonical mapping, kept in checkpoints so that the version can be
            restored after the control plane moved on (None: not checkpointed as a chain).
    """

    version: int | None
    core: Combiner
    from_ms: int | None = None
    until_ms: int | None = None
    spec_doc: dict[str, Any] | None = None

    @property
    def extent(self) -> int:
        """``extent_ms`` of its spec."""
        return extent_ms(self.core.spec)

    def holds(self, batch: BatchInfo) -> bool:
        """Whether a batch may have rows for this stage's windows."""
        return can_hold(batch, self.from_ms, self.until_ms, self.extent)

    def done(self, newer: Stage) -> bool:
        """Whether every window this (closed-ended) stage owns is closed for good.

        Not while either stage re-takes logged closes: the ending flush is one of them.
        """
        core = self.core
        if (
            self.until_ms is None
            or core.closed_through is None
            or core.replaying
            or newer.core.replaying
        ):
            return False
        through = self.until_ms + self.extent + core.spec.allowed_lateness_ms
        if core.closed_through < through or core.sessions.open_sessions():
            return False
        mine, theirs = core.confirmable(), newer.core.confirmable()
        return all(mine.get(g, -1) >= seq for g, seq in theirs.items())

    def describe(self) -> dict[str, Any]:
        """For heartbeats: its version and the window starts it owns."""
        return {"version": self.version, "from_ms": self.from_ms, "until_ms": self.until_ms}


class Chain:
    """The stages of one partition, oldest first; the last is the current version."""

    def __init__(self, first: Stage) -> None:
        self.stages = [first]
        self.retired: list[Stage] = []
        """Stages ended since the runtime last looked (it reports them)."""

    @property
    def current(self) -> Stage:
        """The newest version."""
        return self.stages[-1]

    @property
    def replaying(self) -> bool:
        """Whether some stage still re-takes logged closes (no snapshot may be taken)."""
        return any(s.core.replaying for s in self.stages)

    @property
    def pending_closes(self) -> int:
        """Logged closes not re-taken yet, over every stage."""
        return sum(s.core.pending_closes for s in self.stages)

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions still open, oldest first (unversioned stages left out)."""
        return tuple(s.version for s in self.stages if s.version is not None)

    def update(
        self,
        version: int,
        spec: PipelineSpec,
        clock: Clock,
        *,
        not_before_ms: int,
        spec_doc: dict[str, Any] | None = None,
    ) -> Stage:
        """Open ``version``: the current stage ends at the cut; the new one starts there."""
        old = self.current
        core = Combiner(
            spec,
            old.core.partition,
            clock,
            logged=old.core.close_log.enabled,
            spill=old.core.spill_factory,
            memory_bytes=old.core.memory_bytes,
        )
        seen = [not_before_ms]
        seen += [g.watermark_ms for g in old.core.tracker.gateways.values() if g.watermark_ms]
        seen += [old.core.closed_through] if old.core.closed_through is not None else []
        if old.from_ms is not None:
            seen.append(old.from_ms)
        cut = switch_point(max(seen), _grid(old.core.spec, spec))
        old.until_ms = cut
        _continue(old.core, core)
        stage = Stage(version, core, cut, None, spec_doc)
        self.stages.append(stage)
        return stage

    def stage_of(self, fingerprint: str) -> Stage | None:
        """The stage whose spec has ``fingerprint`` (newest first)."""
        for stage in reversed(self.stages):
            if stage.core.fingerprint == fingerprint:
                return stage
        return None

    def receive(self, partial: Partial) -> list[tuple[Stage, Step]]:
        """A partial to the stage of its version, and stand-ins to the others that need none.

        A partial of no open version goes to the current stage, which refuses it (counted as
        ``foreign_partials``).
        """
        own = self.stage_of(partial.fingerprint)
        if own is None:
            return [(self.current, self.current.core.receive(partial))]
        steps = []
        for stage in self.stages:
            if stage is own:
                steps.append(
                    (stage, stage.core.receive(restrict(partial, stage.from_ms, stage.until_ms)))
                )
            elif not stage.holds(partial.batch):
                steps.append(
                    (stage, stage.core.receive(progress_only(partial, stage.core.fingerprint)))
                )
        return steps

    def receive_status(self, status: GatewayStatus) -> list[tuple[Stage, Step]]:
        """A gateway's status to every stage."""
        return [(s, s.core.receive_status(status)) for s in self.stages]

    def tick(self) -> list[tuple[Stage, Step]]:
        """Every stage's ``tick``."""
        return [(s, s.core.tick()) for s in self.stages]

    def close_ready(self, now_ms: int) -> list[tuple[Stage, ClosedWindows | None]]:
        """Every stage's ``close_ready``."""
        return [(s, s.core.close_ready(now_ms)) for s in self.stages]

    def flush(self) -> list[tuple[Stage, ClosedWindows]]:
        """Every stage's ``flush``."""
        return [(s, s.core.flush()) for s in self.stages]

    def retire(self) -> list[tuple[Stage, ClosedWindows]]:
        """End the old stages that are done; what their flush emits (count windows left)."""
        out = []
        while len(self.stages) > 1 and self.stages[0].done(self.stages[1]):
            stage = self.stages.pop(0)
            out.append((stage, stage.core.flush()))
            self.retired.append(stage)
        return out

    def confirmable(self) -> dict[str, int]:
        """Per gateway, the highest seq every stage has applied with all before it."""
        views = [s.core.confirmable() for s in self.stages]
        first, rest = views[0], views[1:]
        out = {}
        for gateway, seq in first.items():
            lowest = min([seq, *(v.get(gateway, -1) for v in rest)])
            if lowest >= 0:
                out[gateway] = lowest
        return out

    def gaps(self, limit: int) -> dict[str, tuple[int, ...]]:
        """Per gateway, the seqs some stage misses below batches it holds."""
        merged: dict[str, set[int]] = {}
        for stage in self.stages:
            for gateway, seqs in stage.core.gaps(limit).items():
                merged.setdefault(gateway, set()).update(seqs)
        return {g: tuple(sorted(s)[:limit]) for g, s in merged.items()}

    # -- checkpoints ---------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Every stage: version, cut, spec and core snapshot."""
        packed = msgpack.packb(
            {
                "v": CHAIN_VERSION,
                "chain": [
                    {
                        "version": s.version,
                        "from_ms": s.from_ms,
                        "until_ms": s.until_ms,
                        "spec": s.spec_doc,
                        "core": s.core.snapshot(),
                    }
                    for s in self.stages
                ],
            },
            use_bin_type=True,
        )
        assert isinstance(packed, bytes)
        return packed

    @classmethod
    def restore(
        cls,
        data: bytes,
        partition: int,
        clock: Clock,
        parse: Callable[[dict[str, Any]], PipelineSpec],
        *,
        logs: Callable[[int | None], bytes | None] | None = None,
        spill: Callable[[], Spill[Partial]] | None = None,
        memory_bytes: int | None = None,
    ) -> Chain | None:
        """A chain from ``snapshot`` bytes; None when ``data`` is a single core's snapshot.

        ``logs``: each stage's close log by its version (``close_log``): the stages keep
        logs and re-take the closes logged after the snapshot; None: no logs are kept.
        ``spill``, ``memory_bytes``: as ``Combiner`` takes them.

        Raises:
            SchemaError: unreadable, or a stage's spec is no longer valid (``bad_checkpoint``);
                a close log unreadable (``bad_log``).
        """
        obj = _chain_object(data)
        if obj is None:
            return None
        stages = []
        for item in obj["chain"]:
            if item.get("spec") is None:
                raise SchemaError("checkpoint stage without its spec", reason="bad_checkpoint")
            try:
                spec = parse(item["spec"])
            except Exception as exc:
                raise SchemaError(
                    f"checkpoint stage v{item.get('version')}: its spec is invalid: {exc}",
                    reason="bad_checkpoint",
                ) from exc
            core = Combiner(
                spec,
                partition,
                clock,
                logged=logs is not None,
                spill=spill,
                memory_bytes=memory_bytes,
            )
            core.restore(item["core"], None if logs is None else logs(item["version"]))
            stages.append(
                Stage(item["version"], core, item["from_ms"], item["until_ms"], item["spec"])
            )
        if not stages:
            raise SchemaError("checkpoint chain without stages", reason="bad_checkpoint")
        chain = cls(stages[0])
        chain.stages = stages
        return chain


def _chain_object(data: bytes) -> dict[str, Any] | None:
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise SchemaError(f"unreadable checkpoint: {exc}", reason="bad_checkpoint") from exc
    if not isinstance(obj, dict) or "chain" not in obj:
        return None
    if obj.get("v") != CHAIN_VERSION or not isinstance(obj["chain"], list):
        raise SchemaError("checkpoint chain of another version", reason="checkpoint_mismatch")
    return obj


def _grid(old: PipelineSpec, new: PipelineSpec) -> int:
    common = grid_ms([old, new])
    return common if common <= MAX_GRID_MS else grid_ms([old])


def _continue(old: Combiner, new: Combiner) -> None:
    """The new stage starts where the old one is: same next seq and watermark per gateway.

    Every batch before a gateway's next seq was applied by the old stage, all its rows before
    the cut (the cut lies after every applied row): the new version owns none of them.
    """
    for g in old.tracker.gateways.values():
        progress: GatewayProgress[Partial] = GatewayProgress(
            g.gateway_id, g.next_seq, g.watermark_ms, g.last_progress_ms, g.first_seen_ms
        )
        progress.announced_next_seq = g.announced_next_seq
        progress.status_seen_ms = g.status_seen_ms
        progress.hold_ms = g.hold_ms
        progress.released = g.released
        new.tracker.gateways[g.gateway_id] = progress
