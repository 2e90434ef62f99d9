"""Phase two: one combiner partition merges partials, closes windows and knows what to confirm.

This is the pure core (no MQTT, no files): ``receive`` a partial or a gateway status, ``tick``
to close windows, ``snapshot``/``restore`` for checkpoints. The runtime in
``shoal.runtime.combiner`` moves bytes in and out and decides when to checkpoint.

Order of work for one partial (the exactness argument in four steps):

1. Partials of another spec (fingerprint) are refused before sequencing: their gateway
   re-sends the batch and a worker with the right spec handles it.
2. ``ProgressTracker`` releases partials strictly in each gateway's seq order; duplicates die.
3. Each released partial is split by lateness: state rows whose window ended at least
   ``lateness_ms`` before the gateway's watermark *before this batch*, or whose window has
   already closed, are late (counted, reported, never merged); the rest merge into the state.
4. ``tick`` computes the pipeline watermark (minimum over gateways that still hold it) and
   closes every window whose end is at or before it minus ``lateness_ms``; each closes once.

Late corrections (``allowed_lateness_ms`` A > 0; docs/guarantees.md "Late corrections"): in
step 3 a row is late only when its window ended at least ``lateness_ms + A`` before the
gateway's earlier data, or when its window closed at least A before the close threshold
(and was dropped); rows behind by ``lateness_ms`` but within A merge. A closed window stays
in the state until the threshold passes its end by A; a row merged into it makes it publish
again. Its revision is 1 plus the number of batches that brought it such rows (behind by
``lateness_ms``, or arriving after the close), whenever they arrived: applied once each (seq
order), kept in checkpoints, so a duplicate or re-send never makes a revision.

Session windows (``kind = "session"``; docs/architecture.md "Session windows") go to a
``SessionState`` instead of the ``WindowState``: the same steps, with a piece's window
``[first_ts, first_ts + gap_ms)`` for lateness and ``last + 2 * gap_ms`` for its close. With
allowed lateness they are kept and corrected by ``SessionState.close_keeping`` (revision =
publications of a (window, start) message; a session that moved to an earlier start leaves a
retraction in its old start's message), called from ``_close_keeping`` at every logged close.

Count windows (``WindowSpec.by_count``): partials carry rows (``EventRows``), each judged
in step 3 as the 1 ms window at its timestamp; on-time rows wait in ``count.CountState``,
and in step 4 the rows the threshold has passed are final and fill windows of ``n`` rows
(``Combiner._close_counts``), at most once per ``COUNT_CLOSE_INTERVAL_MS`` of the clock. No
corrections (the spec refuses ``allowed_lateness_ms``).

Checkpoint contract: a snapshot holds the merged state (closed windows kept for corrections
included), the revision counts, every gateway's next seq and watermark, the close threshold
and the counters, the alerts' state (``shoal.rules.alerts``), but not early arrivals (they are
re-sent, as they were never confirmed). Confirmations name only seqs covered by a durable
snapshot.

Close log (``shoal.processors.close_log``): every close and flush is recorded with the applied
vector it ran at (``close_log``; the runtime persists it before publishing). ``restore`` with
the log re-takes those closes in order (``replaying``): released batches below the next
logged close's vector are applied, those above it are held, and the close runs once every
batch below its vector is back; so a close that depended on timing, and every correction,
late report and session that followed from it, comes out as before the crash whatever order
the re-sends arrive in. A replay whose gateways stay silent for ``max_hold_ms`` is given up
(counted).

Rules (``shoal.rules``): closed results first feed the alerts (every row), then ``having``
withholds the rows that fail it (counted as ``results_withheld``/``rows_withheld``); the
workers' row stage already removed rows before partials (``rows_filtered``, within
``batch_rows``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.clock import Clock
from shoal.errors import SchemaError, StateCapError, UsageError
from shoal.processors._packing import Part, bin_header, parts
from shoal.processors.close_log import CloseLog, Decision, LogWrite
from shoal.processors.count import ROWS_PER_CELL, CountState
from shoal.processors.partials import (
    EventRows,
    Partial,
    PartialRows,
    pane_partials,
    spec_fingerprint,
)
from shoal.processors.progress import GatewayProgress, ProgressTracker, Spill
from shoal.processors.session_state import SessionClose, SessionState
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import ClosedWindows, WindowState
from shoal.processors.user_aggregates import budget_user_aggregates
from shoal.rules import AlertBook, Transition
from shoal.schemas.control import GatewayStatus
from shoal.schemas.results import RETRACTED

SNAPSHOT_VERSION: Final = 2
COUNT_CLOSE_INTERVAL_MS: Final = 250
"""Count windows close at most once per this much of the (injected) clock: a close step costs
per key it touches (each key's new rows merged into its unfinished window), and a threshold
that moves with every batch made a step per batch, ~1.6 rows a key at 10,000 keys
(docs/benchmarks.md, "Count windows"). Time, not event time, sets the cadence: the runtime's
tick (every ``tick_ms``) keeps calling ``close_ready``, so a threshold that advanced closes
within this interval however the input arrives, or stops. A clock that does not move (an
archive replay) gets a step per ``COUNT_CLOSE_ROWS`` applied instead."""
COUNT_CLOSE_ROWS: Final = 1_000_000
"""Rows applied to count windows after which a close step is due whatever the clock says:
the buffer stays bounded where the clock stands still (``archive.replay``), and at 4M
rows/s this is the interval's worth anyway."""
STEP_MERGE_ROWS: Final = 1 << 16
"""Unmerged state rows past which a step merges (``WindowState.tidy``) between the partials
it applies, not only between messages as the runtime does: a gap closing behind hundreds of
early partials (a partition restored during an overload) releases them in one step, and
unmerged they grew the state by their whole size before one merge sorted all of it, the
peak of a restored combiner in ``shoal bench chaos`` (docs/benchmarks.md, "Memory at rest,
and a restarted combiner")."""
MAX_PENDING_BYTES: Final = 8 * 2**20
"""Memory for partials that arrived ahead of a missing batch, and again for those held while
logged closes are re-taken; beyond it the reorder buffer's newest go to its ``Spill`` if it
has one (the runtime's files, ``runtime._spill``) and, beyond that, are let go (their gateways
send them again, see ``progress``); held ones are let go. 8 MiB: with 32 MiB a combiner
under ``shoal bench chaos`` peaked ~40 MB higher, and 8 MiB brought no more re-sends
(docs/benchmarks.md, "The combiner's allowances")."""


@dataclass
class CombinerCounters:
    """Everything a partition has counted since it was created (kept across restarts)."""

    partials_received: int = 0
    batches_applied: int = 0
    batches_rejected: int = 0
    duplicate_batches: int = 0
    deferred_batches: int = 0
    foreign_partials: int = 0
    rows_applied: int = 0
    batch_rows: int = 0
    rows_late: int = 0
    windows_closed: int = 0
    results_emitted: int = 0
    rows_corrected: int = 0
    corrections_emitted: int = 0
    windows_dropped: int = 0
    rows_filtered: int = 0
    """Rows of applied batches the workers' row stage removed (in ``batch_rows``)."""
    results_withheld: int = 0
    """Result rows (window, key) that ``having`` kept from being published."""
    rows_withheld: int = 0
    """The ``rows`` of those result rows (measurements counted by no published result)."""
    closes_replayed: int = 0
    """Closes and flushes re-taken from the close log after a restore (``close_log``)."""
    replays_abandoned: int = 0
    """Replays given up because a batch the close log names was not sent again in time."""
    partials_over_cap: int = 0
    """Partials refused whole because they could grow the state beyond ``max_state_cells``."""


@dataclass(frozen=True, slots=True)
class LateRows:
    """State rows of one batch that arrived too late to count.

    ``frame`` has ``window``, ``start``, ``end``, ``key``, ``rows``, ``min``, ``max``, ``sum``
    (those the pipeline keeps) and ``reason``: ``behind_watermark`` (the window ended more than
    ``lateness_ms + allowed_lateness_ms`` before the gateway's own earlier data) or
    ``window_closed`` (the window had already been emitted, e.g. after the gateway was idle,
    and is no longer kept for corrections).
    """

    gateway_id: str
    seq: int
    frame: pl.DataFrame

    @property
    def rows(self) -> int:
        """Measurements of the late (window, key) memberships.

        A row late for several windows (hopping windows, or several window specs) counts once
        per window; count one window spec's rows for measurements.
        """
        return int(self.frame["rows"].sum())


@dataclass
class Step:
    """What one call to the combiner produced.

    ``replayed``: closes re-taken from the close log after a restore (published before
    ``closed``, in order). ``over_cap``: partials refused because applying them could grow
    the state beyond ``max_state_cells``, each with its error (the runtime dead-letters them).
    ``sealed_at_ms``: the gateway seal time of each applied batch (0 when it carried none),
    whichever message unblocked it: the runtime measures apply latency from these.
    """

    applied: int = 0
    sealed_at_ms: list[int] = field(default_factory=list)
    late: list[LateRows] = field(default_factory=list)
    closed: ClosedWindows | None = None
    replayed: list[ClosedWindows] = field(default_factory=list)
    over_cap: list[tuple[Partial, StateCapError]] = field(default_factory=list)


class Combiner:
    """The merge/close core of one combiner partition (see the module docstring)."""

    def __init__(
        self,
        spec: PipelineSpec,
        partition: int,
        clock: Clock,
        *,
        max_pending_bytes: int | None = MAX_PENDING_BYTES,
        logged: bool = True,
        spill: Callable[[], Spill[Partial]] | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        """Build one partition's core.

        ``logged``: keep the close log (``close_log``); off for a combiner that never takes a
        snapshot, as entries are only forgotten once a snapshot is durable. ``spill``: makes
        the reorder buffer's overflow store (``progress.Spill``; the runtime's files), one
        per core; None: the overflow is let go. ``memory_bytes``: what the process may use,
        which sizes the state cap when the spec sets none (``PipelineSpec.state_cap``).
        """
        if not 0 <= partition < spec.partitions:
            raise UsageError(f"{spec.name}: partition {partition} outside 0..{spec.partitions - 1}")
        self.spec = spec
        self.partition = partition
        self.clock = clock
        self.memory_bytes = memory_bytes
        self.state_cap = spec.state_cap(memory_bytes)
        """The most open state cells (``max_state_cells``, or sized from ``memory_bytes``)."""
        self.plan = spec.plan()
        self.fingerprint = spec_fingerprint(spec)
        self.tracker: ProgressTracker[Partial] = ProgressTracker(
            spec.idle_timeout_ms,
            spec.hold_bound_ms,
            lateness_ms=spec.lateness_ms,
            max_pending_weight=max_pending_bytes,
            weigh=_partial_bytes,
            spill=None if spill is None else spill(),
        )
        self.spill_factory = spill
        """What made this core's spill: a new version's core gets one of its own."""
        self.state = WindowState(spec, self.plan)
        self.sessions = SessionState(spec, self.plan, self.state.keys)
        self._session_window = np.array(
            [i in self.sessions.windows for i in range(len(spec.windows))], dtype=np.bool_
        )
        self.counts = CountState(spec, self.plan) if any(w.by_count for w in spec.windows) else None
        self.closed_through: int | None = None
        self.counters = CombinerCounters()
        # (window index, start) -> batches that brought late rows (revision = 1 + that)
        self.revisions: dict[tuple[int, int], int] = {}
        self._dirty: set[tuple[int, int]] = set()  # kept closed windows changed since emitted
        self._sessions_revising = False  # session pieces behind the close since the last one
        self._field_names = frozenset(self.plan.field_names)
        self._sizes = np.array([w.size_ms for w in spec.windows], dtype=np.int64)
        self._pane_mode = np.array(pane_partials(spec), dtype=np.bool_)
        self._names = [w.name for w in spec.windows]
        self._session_names = frozenset(self._names[i] for i in self.sessions.windows)
        self._prepared_for: int | None = None
        self._counts_due_ms: int | None = None  # count windows close again from then on
        self._counts_due_rows = 0  # ... or once ``counters.rows_applied`` reaches this
        self.alerts = AlertBook(spec.alerts)
        self.transitions: list[Transition] = []
        """Alert transitions of closed windows, in order, until the runtime takes them."""
        self.close_log = CloseLog(enabled=logged)
        """Closes decided since the last snapshot, for the runtime to persist (``close_log``)."""
        self._replay: deque[Decision] = deque()  # logged closes still to re-take
        self._replayed: list[Decision] = []  # re-taken so far (kept if the replay is given up)
        self._restored: dict[str, int] = {}  # the applied vector of the restored snapshot
        self._held: dict[str, deque[Partial]] = {}  # released batches after the next close
        self._max_held_weight = max_pending_bytes
        self.held_weight = 0
        """About the bytes of ``_held`` (``_partial_bytes``), bounded like the reorder buffer."""
        self._replay_progress_ms = 0
        self.functions = budget_user_aggregates(
            spec.loaded.udafs.values(), spec.degrade_after, clock.monotonic
        )
        """The guard of the spec's UDAF calls here (None: no UDAF; ``user_aggregates``)."""

    # -- input -----------------------------------------------------------------------------

    def receive(self, partial: Partial) -> Step:
        """Take one partial; apply it and whatever it unblocks.

        Partials of another spec, partition or frame layout are refused before sequencing
        (counted as ``foreign_partials``): their gateway re-sends the batch.
        """
        self.counters.partials_received += 1
        rows = partial.rows
        if (
            partial.fingerprint != self.fingerprint
            or partial.partition != self.partition
            or (rows is not None and not self._fits(rows))
            or (rows is not None if self.counts is not None else partial.events is not None)
        ):
            self.counters.foreign_partials += 1
            return Step()
        now = self.clock.now_ms()
        self._note_life(partial.batch.gateway_id, now)
        # Not kept in a local: ``_apply_all`` lets go of a long run as it is applied.
        return self._apply_all(
            self.tracker.offer(partial.batch.gateway_id, partial.batch.seq, partial, now), now
        )

    def _fits(self, rows: PartialRows) -> bool:
        """Whether a partial's rows have this pipeline's state layout."""
        return (
            set(rows.fields) == self._field_names
            and int(rows.window.max(initial=0)) < len(self.spec.windows)
            and (rows.sketch_row is None) != self.plan.needs_sketch
            and (rows.sketch_row is None or int(rows.sketch_row.max(initial=0)) < len(rows))
            and (rows.last is None) == (not self.sessions.windows)
        )

    def receive_status(self, status: GatewayStatus) -> Step:
        """Take a gateway's status (may set its starting seq, unblocking partials)."""
        now = self.clock.now_ms()
        self._note_life(status.gateway_id, now)
        return self._apply_all(self.tracker.note_status(status, now), now)

    def _apply_all(self, ready: list[tuple[int, Partial]], now: int) -> Step:
        """Apply ``ready`` and then the rest of the run it began, a piece at a time.

        A run that waited in the reorder buffer's spill comes back in pieces of about its
        memory bound (``ProgressTracker.release``), each applied before the next is read.
        """
        step = Step()
        while ready:
            if self._replay:
                for _, partial in ready:
                    self._held.setdefault(partial.batch.gateway_id, deque()).append(partial)
                    self.held_weight += _partial_bytes(partial)
                self._bound_held()
                self._run_replay(step, now)
            else:
                # Taken out of the run as they are applied: what is merged can be freed
                # while the rest of a long run (a gap that closed) waits its turn (a 5-s
                # gap's peak 143 -> 126 MB, docs/bench/combiner_gap_memory.py).
                run = deque(partial for _, partial in ready)
                ready = []
                while run:
                    self._apply_into(step, run.popleft(), now)
            ready = [(seq, partial) for _, seq, partial in self.tracker.release()]
        gateways = self.tracker.gateways.values()
        self.counters.duplicate_batches = sum(g.duplicates for g in gateways)
        self.counters.deferred_batches = sum(g.deferred for g in gateways)
        return step

    def _apply_into(self, step: Step, partial: Partial, now: int) -> None:
        refusal = self._over_cap(partial)
        if refusal is not None:
            # Refused whole, never applied in part: the runtime dead-letters it with its rows
            # (docs/guarantees.md "Bounded memory"). Its seq is handled and, unlike a batch a
            # worker rejected, its event times count as progress: windows keep closing and
            # freeing state, so a gateway whose batches are all refused cannot freeze them.
            batch = partial.batch
            self.counters.partials_over_cap += 1
            self.tracker.applied(batch.gateway_id, batch.max_ts, now)
            step.over_cap.append((partial, refusal))
            return
        late = self._apply(partial, now)
        step.applied += 1
        step.sealed_at_ms.append(partial.batch.sent_at_ms)
        if late is not None:
            step.late.append(late)
        if self.state.pending_rows >= STEP_MERGE_ROWS:
            self.state.tidy()

    @property
    def state_cells(self) -> int:
        """Cells of open state that ``state_cap`` bounds (unmerged pieces included)."""
        counts = 0 if self.counts is None else self.counts.held_cells
        return self.state.rows + self.sessions.held_cells() + counts

    def _over_cap(self, partial: Partial) -> StateCapError | None:
        """The error if applying ``partial`` could grow the state beyond ``state_cap``.

        The partial's rows and sketch buckets count in full (an upper bound: some may merge
        into cells already held). Past the cap the state is merged first, so the decision
        depends only on which batches were applied, never on when merging happened to run.
        """
        rows, events = partial.rows, partial.events
        if (rows is None and events is None) or partial.batch.status != "ok":
            return None
        cap = self.state_cap
        # count windows: buffered rows, ROWS_PER_CELL to a cell
        incoming = 0 if events is None else -(-len(events) // ROWS_PER_CELL)
        if rows is not None:
            incoming += len(rows) + (0 if rows.sketch_bucket is None else len(rows.sketch_bucket))
        if self.state_cells + incoming <= cap:
            return None
        self.state.compact()
        held = self.state_cells
        if held + incoming <= cap:
            return None
        batch = partial.batch
        return StateCapError(
            gateway_id=batch.gateway_id, seq=batch.seq, cells=held, incoming=incoming, cap=cap
        )

    def _apply(self, partial: Partial, now: int) -> LateRows | None:
        batch = partial.batch
        if batch.status != "ok":
            self.counters.batches_rejected += 1
            self.tracker.refused(batch.gateway_id)  # not progress: see ``ProgressTracker``
            return None
        late = None
        rows = partial.rows
        if partial.events is not None:
            late = self._apply_events(batch.gateway_id, batch.seq, partial.events)
        if rows is not None and len(rows) and self._pane_mode.any():
            rows = self._apply_panes(rows, self.tracker.watermark(batch.gateway_id))
        if rows is not None and len(rows):
            wm_before = self.tracker.watermark(batch.gateway_id)
            end = rows.start + self._sizes[rows.window.astype(np.int64)]
            allowed = self.spec.allowed_lateness_ms
            nothing = np.zeros(len(end), dtype=bool)
            behind = nothing if wm_before is None else end + self.spec.lateness_ms <= wm_before
            beyond = (
                behind
                if wm_before is None or not allowed
                else end + allowed <= wm_before - self.spec.lateness_ms
            )
            closed = nothing if self.closed_through is None else end <= self.closed_through
            dropped = (
                closed
                if self.closed_through is None or not allowed
                else end <= self.closed_through - allowed
            )
            is_late = beyond | dropped
            in_session = self._session_window[rows.window.astype(np.int64)]
            self.state.add(rows, keep=~is_late & ~in_session)
            self.sessions.add(rows, keep=~is_late & in_session)
            n = rows.fields["n"]
            self.counters.rows_applied += int(n[~is_late].sum())
            if allowed:
                revising = (behind | closed) & ~is_late
                # Sessions count their revisions per publication (``SessionState``); a piece
                # behind the close may reach a published session: the next close decides.
                into_session = revising & in_session
                if into_session.any():
                    self._sessions_revising = True
                    self.counters.rows_corrected += int(n[into_session & closed].sum())
                self._revise(rows, revising & ~in_session, closed)
            if is_late.any():
                late = self._late(
                    batch.gateway_id, batch.seq, rows, is_late=is_late, behind=beyond, end=end
                )
                self.counters.rows_late += late.rows
        self.counters.batches_applied += 1
        self.counters.batch_rows += batch.rows
        self.counters.rows_filtered += batch.filtered
        offset = batch.received_at_ms - batch.sent_at_ms if batch.sent_at_ms > 0 else None
        self.tracker.applied(batch.gateway_id, batch.max_ts, now, clock_offset_ms=offset)
        return late

    def _apply_panes(self, rows: PartialRows, wm_before: int | None) -> PartialRows | None:
        """Take a batch's pane rows into the pane state if on time; the rows left to apply.

        On time: the oldest window of every pane (ending a step after the pane's start) is
        neither ``lateness_ms`` behind the gateway's earlier data nor closed
        (``WindowState.take_panes``, which expands the rows into window rows otherwise).
        """
        lateness, closed = self.spec.lateness_ms, self.closed_through

        def on_time(oldest_end: npt.NDArray[np.int64]) -> bool:
            return (wm_before is None or bool((oldest_end + lateness > wm_before).all())) and (
                closed is None or bool((oldest_end > closed).all())
            )

        rest, memberships = self.state.take_panes(rows, on_time)
        self.counters.rows_applied += memberships
        return rest

    def _apply_events(self, gateway_id: str, seq: int, events: EventRows) -> LateRows | None:
        """Count windows: buffer a batch's on-time rows; the late ones are reported.

        A row is late as the 1 ms window at its time would be: behind the gateway's earlier
        data by ``lateness_ms`` or more, or at a time the close threshold already passed.
        """
        assert self.counts is not None
        if len(events) == 0:
            return None
        wm_before = self.tracker.watermark(gateway_id)
        # Late: its 1 ms window ``[ts, ts + 1)`` ended ``lateness_ms`` or more before the
        # watermark (behind), or at or before ``closed_through`` (closed): ``ts`` below either.
        behind_below = None if wm_before is None else wm_before - self.spec.lateness_ms
        bounds = [b for b in (behind_below, self.closed_through) if b is not None]
        late_below = max(bounds, default=None)
        if late_below is None or int(np.minimum.reduce(events.ts)) >= late_below:
            kept = self.counts.add(events, gateway_id, seq, None)  # none late: the usual case
            self.counters.rows_applied += kept * len(self.counts.windows)
            return None
        is_late = events.ts < late_below
        kept = self.counts.add(events, gateway_id, seq, ~is_late)
        self.counters.rows_applied += kept * len(self.counts.windows)
        picked = np.flatnonzero(is_late)
        late_ts = events.ts[picked]
        behind = np.zeros(len(picked), bool) if behind_below is None else late_ts < behind_below
        keys = [events.keys[k] for k in events.key[picked].tolist()]
        one: dict[str, object] = {
            "start": late_ts,
            "end": late_ts + 1,
            "key": pl.Series(keys, dtype=pl.String),
            "rows": np.ones(len(picked), dtype=np.int64),
            **{c: events.value[picked] for c in ("min", "max", "sum") if c in self._field_names},
            "reason": np.where(behind, "behind_watermark", "window_closed"),
        }
        frame = pl.concat(
            pl.DataFrame(one).select(pl.lit(w.name).alias("window"), pl.all())
            for w in self.counts.windows
        )
        late = LateRows(gateway_id, seq, frame)
        self.counters.rows_late += late.rows
        return late

    def _revise(
        self, rows: PartialRows, revising: npt.NDArray[np.bool_], closed: npt.NDArray[np.bool_]
    ) -> None:
        """Count one more revision for each window this batch brought late rows to.

        Windows already closed (kept for corrections) are marked for publishing again.
        """
        if not revising.any():
            return
        picked = np.flatnonzero(revising)
        pairs = set(zip(rows.window[picked].tolist(), rows.start[picked].tolist(), strict=True))
        for pair in pairs:
            self.revisions[pair] = self.revisions.get(pair, 0) + 1
        into_closed = revising & closed
        if into_closed.any():
            self.counters.rows_corrected += int(rows.fields["n"][into_closed].sum())
            picked = np.flatnonzero(into_closed)
            self._dirty.update(
                zip(rows.window[picked].tolist(), rows.start[picked].tolist(), strict=True)
            )

    def _late(
        self,
        gateway_id: str,
        seq: int,
        rows: PartialRows,
        *,
        is_late: npt.NDArray[np.bool_],
        behind: npt.NDArray[np.bool_],
        end: npt.NDArray[np.int64],
    ) -> LateRows:
        picked = np.flatnonzero(is_late)
        columns: dict[str, object] = {
            "window": [self._names[w] for w in rows.window[picked].tolist()],
            "start": rows.start[picked],
            "end": end[picked],
            "key": pl.Series([rows.keys[i] for i in picked.tolist()], dtype=pl.String),
            "rows": rows.fields["n"][picked],
            **{c: rows.fields[c][picked] for c in ("min", "max", "sum") if c in rows.fields},
            "reason": np.where(behind[picked], "behind_watermark", "window_closed"),
        }
        return LateRows(gateway_id, seq, pl.DataFrame(columns))

    # -- time --------------------------------------------------------------------------------

    def tick(self) -> Step:
        """Start gateways that never announced themselves, then close what can close.

        A replay of the close log whose gateways have been silent for ``max_hold_ms`` while
        it waited for their batches is given up (counted): the rest of the log is forgotten
        and the combiner runs freely.
        """
        now = self.clock.now_ms()
        step = self._apply_all(
            [(seq, partial) for _, seq, partial in self.tracker.resolve_starts(now)], now
        )
        if self._replay and now - self._replay_progress_ms >= self.spec.hold_bound_ms:
            self._abandon_replay(step, now)
        step.closed = self.close_ready(now)
        return step

    # -- the close log (``close_log``) -------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether logged closes are still being re-taken (no snapshot may be taken)."""
        return bool(self._replay)

    @property
    def pending_closes(self) -> int:
        """Logged closes not re-taken yet."""
        return len(self._replay)

    def take_log(self) -> LogWrite | None:
        """Close-log bytes to write before publishing what this core decided so far."""
        return self.close_log.take()

    def _vector(self) -> dict[str, int]:
        """The applied vector: per gateway, the next seq to apply."""
        return {
            g: p.next_seq - len(self._held.get(g, ()))
            for g, p in self.tracker.gateways.items()
            if p.next_seq is not None
        }

    def _note_life(self, gateway_id: str, now: int) -> None:
        """A replay waiting for this gateway's batches goes on waiting while it sends.

        Any copy counts, a duplicate included: a gateway that sends re-sends its oldest
        unconfirmed batches first, so the one the logged close waits for comes (after a
        backlog, under overload, that can take far longer than ``max_hold_ms``). A replay
        is given up only when the gateways it waits for stay silent that long.
        """
        if self._replay:
            needed = self._replay[0].applied.get(gateway_id)
            progress = self.tracker.gateways.get(gateway_id)
            next_seq = None if progress is None else progress.next_seq
            applied = -1 if next_seq is None else next_seq - len(self._held.get(gateway_id, ()))
            if needed is not None and applied < needed:
                self._replay_progress_ms = now

    def _bound_held(self) -> None:
        """Let go of the newest held batches while the hold is over its limit.

        As the reorder buffer does (``ProgressTracker._bound``): the gateway holding the
        most gives up its newest held batch, and its next seq steps back over it, so the
        copy its gateway sends again (it is unconfirmed: only the restored vector is
        confirmed while replaying) is taken as new. Counted as ``deferred``. A held batch is
        always the last released one of its gateway, so stepping back keeps the applied
        vector (next seq minus held) as it was.
        """
        limit = self._max_held_weight
        if limit is None:
            return
        while self.held_weight > limit:
            gateway_id, queue = max(
                ((g, q) for g, q in self._held.items() if q),
                key=lambda item: sum(_partial_bytes(p) for p in item[1]),
                default=(None, None),
            )
            if gateway_id is None or queue is None:
                return
            partial = queue.pop()
            self.held_weight -= _partial_bytes(partial)
            progress = self.tracker.gateways[gateway_id]
            assert progress.next_seq is not None
            progress.next_seq -= 1
            progress.deferred += 1

    def _run_replay(self, step: Step, now: int) -> None:
        """Re-take every logged close whose batches are all back; hold the later batches."""
        while self._replay:
            decision = self._replay[0]
            for gateway_id, held in self._held.items():
                limit = decision.applied.get(gateway_id)
                while held and limit is not None and held[0].batch.seq < limit:
                    partial = held.popleft()
                    self.held_weight -= _partial_bytes(partial)
                    self._apply_into(step, partial, now)
                    self._replay_progress_ms = now
            applied = self._vector()
            if any(applied.get(g, -1) < seq for g, seq in decision.applied.items()):
                return  # a batch applied before this close has not been sent again yet
            self._replay.popleft()
            self._replayed.append(decision)
            self.counters.closes_replayed += 1
            self._replay_progress_ms = now
            closed = self._having(
                self._flush() if decision.kind == "flush" else self._close_at(decision.threshold)
            )
            if closed is not None and not closed.empty:
                step.replayed.append(closed)
        self._end_replay(step, now)

    def _abandon_replay(self, step: Step, now: int) -> None:
        """Forget the logged closes not re-taken yet and run freely (counted)."""
        self.counters.replays_abandoned += 1
        self.close_log.keep(self._replayed, self._restored)
        self._replay.clear()
        self._end_replay(step, now)

    def _end_replay(self, step: Step, now: int) -> None:
        """Apply the batches held for after the last logged close, in each gateway's order."""
        held, self._held = self._held, {}
        self.held_weight = 0
        for queue in held.values():
            for partial in queue:
                self._apply_into(step, partial, now)
        self._replayed = []

    def close_threshold(self, now_ms: int) -> int | None:
        """Windows ending at or before this may close (pipeline watermark minus lateness)."""
        watermark = self.tracker.pipeline_watermark(now_ms)
        return None if watermark is None else watermark - self.spec.lateness_ms

    def close_ready(self, now_ms: int) -> ClosedWindows | None:
        """Close every window the watermark has passed; None if none closes.

        With allowed lateness, also the new revisions of closed windows that late rows
        changed since they were last published. Result rows failing ``having`` are withheld.
        """
        return self._having(self._close_ready(now_ms))

    def _having(self, closed: ClosedWindows | None) -> ClosedWindows | None:
        """Evaluate alerts; withhold (and count) the result rows that fail ``having``."""
        if closed is None or closed.empty:
            return closed
        frame, retractions = closed.frame, None
        if RETRACTED in frame.columns:  # session retractions: no alert, never withheld
            moved = frame[RETRACTED].is_not_null()
            frame, retractions = frame.filter(~moved), frame.filter(moved)
        if self.spec.alerts:  # alerts see every result row, before having
            self.transitions.extend(self.alerts.evaluate(frame.drop(RETRACTED, strict=False)))
        rule = self.spec.having_rule
        if rule is None:
            return closed
        passing = rule.apply(frame)
        withheld = frame.height - passing.height
        if not withheld:
            return closed  # the same frame: results rendered ahead of the close still apply
        self.counters.results_withheld += withheld
        self.counters.rows_withheld += int(frame["rows"].sum()) - int(passing["rows"].sum())
        if retractions is not None and retractions.height:
            passing = pl.concat([passing, retractions]).sort("window", "start", maintain_order=True)
        return ClosedWindows(passing, closed.revisions, closed.sessions)

    def _close_ready(self, now_ms: int) -> ClosedWindows | None:
        if self._replay:
            return None  # closes are re-taken from the log, each once its batches are back
        if (
            self._counts_due_ms is not None
            and now_ms < self._counts_due_ms
            and self.counters.rows_applied < self._counts_due_rows
        ):
            return None  # count windows: a step per COUNT_CLOSE_INTERVAL_MS (or _ROWS) at most
        threshold = self.close_threshold(now_ms)
        decides = (
            bool(self._dirty)
            or self._sessions_revising
            or (
                threshold is not None
                and (self.closed_through is None or threshold > self.closed_through)
            )
        )
        closed = self._close_at(threshold)
        if decides and self.counts is not None:
            self._counts_due_ms = now_ms + COUNT_CLOSE_INTERVAL_MS
            self._counts_due_rows = self.counters.rows_applied + COUNT_CLOSE_ROWS
        if decides:
            # Logged even when nothing is published: the threshold judges later batches.
            self.close_log.record(
                Decision("close", threshold, self._vector()),
                sync=closed is not None and not closed.empty,
            )
        return closed

    def _close_at(self, threshold: int | None) -> ClosedWindows | None:
        if self.counts is not None:
            return self._close_counts(threshold)
        if self.spec.allowed_lateness_ms:
            return self._close_keeping(threshold)
        if threshold is None or (
            self.closed_through is not None and threshold <= self.closed_through
        ):
            return None
        self.closed_through = threshold
        return self._count_closed(self._close_aligned(threshold), self.sessions.close(threshold))

    def _close_aligned(self, threshold: int) -> pl.DataFrame | None:
        """Close the aligned windows ending at or before ``threshold``, else prepare."""
        next_end = self.state.next_end()
        if next_end is None or next_end > threshold:
            # Nothing closes yet. Once the watermark has passed the next window's end, only
            # late rows can still reach it: finalise it now, so that the close (at end +
            # lateness) has nothing left to compute unless a late row arrives meanwhile.
            if (
                next_end is not None
                and threshold + self.spec.lateness_ms >= next_end
                and self._prepared_for != next_end
            ):
                self.state.prepare(next_end)
                self._prepared_for = next_end
            return None
        return self.state.close(threshold).frame

    def _count_closed(self, *frames: pl.DataFrame | None) -> ClosedWindows | None:
        """Closed aligned windows and sessions as one ``ClosedWindows``, counted."""
        parts = [f for f in frames if f is not None and f.height]
        if not parts:
            return None
        frame = parts[0] if len(parts) == 1 else pl.concat(parts)
        self.counters.windows_closed += frame.select(pl.struct("window", "start").n_unique()).item()
        self.counters.results_emitted += frame.height
        return ClosedWindows(frame, sessions=self._session_names)

    def _close_counts(self, threshold: int | None, *, flush: bool = False) -> ClosedWindows | None:
        """Count windows: rows before the threshold are final; emit the windows they fill.

        Results carry the step's event-time span ``[closed_through before, threshold)`` as
        their ``start``/``end`` (every window closed here has its last row in it).
        """
        assert self.counts is not None
        if threshold is None or (
            not flush and self.closed_through is not None and threshold <= self.closed_through
        ):
            return None
        since = self.closed_through
        if since is None:
            buffered = self.counts.buffered_span()
            since = threshold if buffered is None else min(threshold, buffered[0])
        self.closed_through = max(threshold, since)
        frame = self.counts.finalise(threshold, (since, threshold), flush=flush)
        if frame.height == 0:
            return None
        self.counters.windows_closed += frame.height
        self.counters.results_emitted += frame.height
        return ClosedWindows(frame)

    def _close_keeping(self, threshold: int | None) -> ClosedWindows | None:
        """``close_ready`` with allowed lateness: closed windows stay for corrections.

        Publishes the windows the threshold passed and the kept ones that changed, then
        forgets the windows the threshold passed by more than the allowed lateness.
        """
        closing: list[tuple[int, int]] = []
        advanced = threshold is not None and (
            self.closed_through is None or threshold > self.closed_through
        )
        if advanced and threshold is not None:
            closing = self.state.windows_between(self.closed_through, threshold)
            self.closed_through = threshold
        revised = sorted(self._dirty)
        self._dirty.clear()
        sessions = self._close_sessions_keeping(advanced=advanced)
        if not closing and not revised and sessions.frame is None:
            self._drop_expired()
            return None
        frame = self.state.peek(sorted({*closing, *revised}))
        if advanced and threshold is not None:
            self.state.release_stacks(threshold)  # closed: only corrections finalise them again
        self.counters.windows_closed += len(closing) + sessions.closed
        self.counters.corrections_emitted += len(set(revised) - set(closing)) + sessions.corrections
        revisions = {
            (self._names[w], s): 1 + self.revisions[(w, s)]
            for w, s in {*closing, *revised}
            if (w, s) in self.revisions
        }
        if sessions.frame is not None:
            revisions.update(sessions.revisions)
            parts = [f for f in (frame, sessions.frame) if f.height]
            frame = parts[0] if len(parts) == 1 else pl.concat(parts, how="diagonal_relaxed")
        self.counters.results_emitted += frame.height
        self._drop_expired()  # after the last results of the windows it forgets
        return ClosedWindows(frame, revisions, sessions=self._session_names)

    def _close_sessions_keeping(self, *, advanced: bool) -> SessionClose:
        """Session windows with allowed lateness: new sessions and corrections (``SessionState``).

        Runs when the threshold advanced or a piece behind the close came (both logged
        decisions, see ``_close_ready``): the sessions are not merged at every tick.
        """
        revising, self._sessions_revising = self._sessions_revising, False
        if not self.sessions.windows or not (advanced or revising):
            return SessionClose(None, {})
        return self.sessions.close_keeping(self.closed_through, self.spec.allowed_lateness_ms)

    def _drop_expired(self) -> None:
        """Forget closed windows the close threshold passed by the allowed lateness."""
        if self.closed_through is None:
            return
        through = self.closed_through - self.spec.allowed_lateness_ms
        self.counters.windows_dropped += self.state.drop(through)
        for w, s in [k for k in self.revisions if k[1] + int(self._sizes[k[0]]) <= through]:
            del self.revisions[(w, s)]

    def kept_windows(self) -> int:
        """Closed windows held for corrections (each at most ``allowed_lateness_ms``)."""
        if self.closed_through is None or not self.spec.allowed_lateness_ms:
            return 0
        return self.state.windows_through(self.closed_through) + self.sessions.kept()

    def flush(self) -> ClosedWindows:
        """Close every open window now, as at the end of the input (``having`` applied)."""
        closed = self.flush_step().closed
        assert closed is not None
        return closed

    def flush_step(self) -> Step:
        """``flush``, with the late rows of batches it had to apply first.

        During a replay of the close log, the logged closes still waiting for their batches
        are given up first (a flush is the operator's end of input) and the held batches are
        applied.
        """
        step = Step()
        if self._replay:
            self._abandon_replay(step, self.clock.now_ms())
        step.closed = self._having(self._flush())
        self.close_log.record(Decision("flush", None, self._vector()))
        return step

    def _flush(self) -> ClosedWindows:
        """Close every open window now, as at the end of the input.

        Later rows for these windows count as late (``window_closed``), or, with allowed
        lateness, fold in while the windows are kept. Used when a pipeline is shut down on
        purpose, so that no result stays behind in an open window.
        """
        if self.counts is not None:
            # Every buffered row is final now; unfinished windows leave with rows < n.
            buffered = self.counts.buffered_span()
            ends = [e for e in (self.closed_through, buffered and buffered[1] + 1) if e]
            closed = self._close_counts(max(ends, default=None), flush=True)
            return closed or ClosedWindows(self.counts.empty_result())
        if self.spec.allowed_lateness_ms:
            ends = [
                s + int(self._sizes[w])
                for w, s in self.state.windows_between(self.closed_through, 2**62)
            ]
            reach = self.sessions.reach()
            ends += [] if reach is None else [reach]
            last = max(ends, default=self.closed_through)
            closed = None if last is None else self._close_keeping(last)
            return closed or ClosedWindows(self.state.empty_result())
        aligned = self.state.close(2**62).frame
        sessions, sessions_through = self.sessions.close_all()
        ends = [] if aligned.is_empty() else [int(aligned["end"].max())]  # type: ignore[arg-type]
        for through in [*ends, *([] if sessions_through is None else [sessions_through])]:
            self.closed_through = max(self.closed_through or through, through)
        closed = self._count_closed(aligned, sessions)
        return closed or ClosedWindows(self.state.empty_result())

    def take_transitions(self) -> list[Transition]:
        """The alert transitions made since the last call (the runtime publishes them)."""
        taken, self.transitions = self.transitions, []
        return taken

    # -- confirmations and checkpoints ---------------------------------------------------------

    def confirmable(self) -> dict[str, int]:
        """Highest contiguous applied seq per gateway (the restored ones while replaying)."""
        if self._replay:
            return {g: seq - 1 for g, seq in self._restored.items()}
        return self.tracker.confirmable()

    def gaps(self, limit: int) -> dict[str, tuple[int, ...]]:
        """Per gateway, seqs missing below batches already held (see ``ProgressTracker.gaps``)."""
        return self.tracker.gaps(limit)

    def watermark(self) -> int | None:
        """The pipeline watermark right now (for metrics)."""
        return self.tracker.pipeline_watermark(self.clock.now_ms())

    def snapshot(self) -> bytes:
        """Serialise everything needed to resume exactly (see the module docstring).

        Marks the close log: once this snapshot is durable, ``close_log.settle`` with its
        generation keeps only the closes decided after it.

        Raises:
            UsageError: while logged closes are being re-taken (``replaying``).
        """
        return b"".join(self.snapshot_parts())

    def snapshot_parts(self) -> list[Part]:
        """``snapshot``'s bytes in pieces, nothing large copied (what the runtime writes).

        The same bytes as ``snapshot`` once joined. At 100,000 keys a sliding window's panes
        pack to some 80 MB; joining them into one object every checkpoint copied them all on
        the event loop (and mapped and zeroed 80 MB of fresh memory), while the file they go
        to takes them piece by piece (``write_atomically``).

        Raises:
            UsageError: while logged closes are being re-taken (``replaying``).
        """
        if self._replay:
            raise UsageError(f"{self.spec.name}: no snapshot while the close log is replayed")
        generation = self.close_log.mark(self._vector())
        state = self.state.snapshot_rows()
        panes, panes_forgotten = self.state.snapshot_panes()
        sessions = self.sessions.snapshot_rows()
        gateways = [
            {
                "gateway_id": g.gateway_id,
                "next_seq": g.next_seq,
                "watermark_ms": g.watermark_ms,
                "announced_next_seq": g.announced_next_seq,
                "applied": g.applied,
                "duplicates": g.duplicates,
                "skipped": g.skipped,
                "deferred": g.deferred,
                "refused": g.refused,
                "last_refused": g.last_refused,
                "hold_ms": g.hold_ms,
                "released": g.released,
            }
            for g in self.tracker.gateways.values()
            if g.next_seq is not None
        ]
        return _pack_parts(
            {
                "v": SNAPSHOT_VERSION,
                "pipeline": self.spec.name,
                "partition": self.partition,
                "fingerprint": self.fingerprint,
                "generation": generation,
                "closed_through": self.closed_through,
                "revisions": [[w, s, n] for (w, s), n in sorted(self.revisions.items())],
                "dirty": [[w, s] for w, s in sorted(self._dirty)],
                "sessions_revising": self._sessions_revising,
                "session_corrections": self.sessions.snapshot_corrections(),
                "counters": asdict(self.counters),
                "gateways": gateways,
                "state": None if state is None else state.pack(),
                **(
                    {}
                    if panes is None and panes_forgotten is None
                    else {
                        "pane_chunks": panes,
                        "panes_forgotten": panes_forgotten,
                    }
                ),
                "sessions": None if sessions is None else sessions.pack(),
                **({} if self.counts is None else {"counts": self.counts.snapshot()}),
                **({"alerts": self.alerts.snapshot()} if self.spec.alerts else {}),
                "taken_at": self.clock.now_ms(),
            },
        )

    def restore(self, data: bytes | None, log: bytes | None = None) -> None:
        """Resume from a snapshot taken by ``snapshot`` (same spec and partition) and the log.

        ``data`` None: no snapshot was ever taken (empty state). ``log``: the close log's file
        (``close_log``): the closes decided after the snapshot are re-taken, each once the
        batches applied before it have been sent again (``replaying``), so that what was
        published before the crash is published again alike. Gateways count as freshly
        active: they hold the watermark for ``idle_timeout_ms`` after a restart, giving
        re-sent batches time to arrive before windows close.
        """
        generation = 0 if data is None else self._restore_snapshot(data)
        self._restored = {
            g: p.next_seq for g, p in self.tracker.gateways.items() if p.next_seq is not None
        }
        self._replay = deque(self.close_log.load(log, generation, self._restored))
        self._replayed, self._held = [], {}
        self.held_weight = 0
        self._replay_progress_ms = self.clock.now_ms()

    def _restore_snapshot(self, data: bytes) -> int:
        """Restore a snapshot's state; returns its generation."""
        try:
            obj: dict[str, Any] = msgpack.unpackb(data, raw=False)
        except Exception as exc:
            raise SchemaError(f"unreadable checkpoint: {exc}", reason="bad_checkpoint") from exc
        if not isinstance(obj, dict):
            raise SchemaError("unreadable checkpoint: not a map", reason="bad_checkpoint")
        if (
            obj.get("v") != SNAPSHOT_VERSION
            or obj.get("fingerprint") != self.fingerprint
            or obj.get("partition") != self.partition
        ):
            raise SchemaError(
                "checkpoint was written for another pipeline spec, partition or version",
                reason="checkpoint_mismatch",
                expected=f"{self.fingerprint} partition {self.partition}",
                found=f"{obj.get('fingerprint')} partition {obj.get('partition')}",
            )
        now = self.clock.now_ms()
        self.closed_through = obj["closed_through"]
        self.counters = CombinerCounters(**obj["counters"])
        self.revisions = {(w, s): n for w, s, n in obj.get("revisions", [])}
        self._dirty = {(w, s) for w, s in obj.get("dirty", [])}
        self.tracker.reset()
        for g in obj["gateways"]:
            progress: GatewayProgress[Partial] = GatewayProgress(
                g["gateway_id"], g["next_seq"], g["watermark_ms"], now, now
            )
            progress.announced_next_seq = g["announced_next_seq"]
            progress.applied = g["applied"]
            progress.duplicates = g["duplicates"]
            progress.skipped = g["skipped"]
            progress.deferred = g.get("deferred", 0)
            # A bounded hold survives a restart: a released gateway stays released and the
            # hold time of one that keeps others waiting goes on counting.
            progress.refused = g.get("refused", 0)
            progress.last_refused = g.get("last_refused", False)
            progress.hold_ms = g.get("hold_ms", 0)
            progress.released = g.get("released", False)
            self.tracker.gateways[progress.gateway_id] = progress
        self.state.restore(None if obj["state"] is None else PartialRows.unpack(obj["state"]))
        panes = obj.get("pane_chunks")
        if panes is None and obj.get("panes") is not None:  # written before pane chunks
            panes = PartialRows.unpack(obj["panes"])
        self.state.restore_panes(panes, obj.get("panes_forgotten"))
        sessions = obj.get("sessions")  # after the state: it shares the state's key ids
        self.sessions.restore(
            None if sessions is None else PartialRows.unpack(sessions),
            obj.get("session_corrections"),
        )
        self._sessions_revising = bool(obj.get("sessions_revising", False))
        if self.counts is not None:
            self.counts.restore(obj.get("counts"))
        self.alerts.restore(obj.get("alerts"))
        self.transitions = []
        generation = obj.get("generation", 0)
        return generation if isinstance(generation, int) else 0


def _partial_bytes(partial: Partial) -> int:
    """About the memory a held partial takes (its arrays, plus its keys)."""
    rows = partial.rows
    if partial.events is not None:
        events = partial.events
        return 256 + 32 * len(events) + 64 * len(events.keys)
    if rows is None:
        return 256
    arrays: list[npt.NDArray[Any]] = [rows.window, rows.start, *rows.fields.values()]
    arrays += [] if rows.last is None else [rows.last]
    arrays += [a for a in (rows.sketch_row, rows.sketch_bucket, rows.sketch_count) if a is not None]
    return 256 + sum(int(a.nbytes) for a in arrays) + 64 * len(rows.keys)


def _pack_parts(snapshot: dict[str, Any]) -> list[Part]:
    """``msgpack.packb(snapshot, use_bin_type=True)`` in pieces: nothing large copied.

    The map is packed key by key in its order; each value in pieces (``_packing.parts``: as
    its packer's own buffer, a count window's buffered chunks, ``Packed`` once while they
    stay buffered, by reference); ``pane_chunks``' packed key names and pane blobs go in as
    a bin header followed by the blob itself, which is what ``packb`` writes for them
    (``tests/unit/processors/test_sliding.py`` and ``test_count_windows.py`` hold the two
    equal).
    """
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[Part] = [packer.pack_map_header(len(snapshot))]
    for name, value in snapshot.items():
        pieces.append(packer.pack(name))
        if name != "pane_chunks" or value is None:
            pieces += parts(value)
            continue
        keys, panes = value["keys"], value["panes"]
        pieces += [packer.pack_map_header(2), packer.pack("keys")]
        pieces.append(packer.pack_array_header(len(keys)))
        for chunk in keys:
            pieces += [bin_header(len(chunk)), chunk]
        pieces += [packer.pack("panes"), packer.pack_array_header(len(panes))]
        for window, start, blob in panes:
            pieces += [packer.pack_array_header(3), packer.pack(window), packer.pack(start)]
            pieces += [bin_header(len(blob)), blob]
    return pieces
