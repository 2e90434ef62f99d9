"""Open sessions of one combiner partition: session pieces merged per key, closed on the watermark.

The session-window twin of ``state.WindowState`` (which holds the aligned windows). Aligned
state is keyed by a window's start, which a row's timestamp alone decides; a session's start
(its first timestamp) moves whenever an earlier piece joins it, so open sessions are held per
(window, key) as intervals instead: ``key``, ``first``, ``last`` and the registry's state
fields, one entry per piece until a merge (``SessionRule.merge_intervals``, then the fields'
merge kernels over its labels) makes them one entry per session. ``last`` is generic: the
largest event time of the rows in an entry, merged by max.

Closing (docs/architecture.md, "Session windows"): a session closes once the close threshold
(pipeline watermark minus ``lateness_ms``) reaches ``last + 2 * gap_ms``; from then on no piece
that is not late can join it. Results are published per (window, start), so that a message's
identity fixes its content: sessions of several keys that share a start close together, and a
session waits while another one with its start is still open (no new session can take that
start later: a piece that is not late starts after the threshold minus ``gap_ms``).

Corrections (``allowed_lateness_ms`` A > 0; docs/guarantees.md "Session windows"):
``close_keeping`` replaces ``close``. Closed sessions stay, merged, until the threshold passes
``last + 2 * gap_ms`` by A. Each entry remembers the ``start`` it was published under
(``pub``); a late piece that merges into a published session makes its message *dirty*, and
one that moves the session's start earlier (extending it backwards, or bridging it with an
earlier session) also leaves a *retraction* behind in the message of the old start: a result
row with ``rows`` 0 and ``superseded_by`` (the new start). A dirty message is published again,
whole (every key whose session has that start, plus its retractions), once every session
with that start may close; its revision is the number of times it has been published, so
one revision has one content. The counts live in checkpoints with the kept sessions.

Imports only ``processors`` modules below it (no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.processors._kernels import (
    cell_buckets,
    cell_groups,
    cell_ids,
    merge_cells,
    merge_state,
)
from shoal.processors.aggregates import QUANTILES, AggregatePlan
from shoal.processors.partials import PartialRows, session_rule
from shoal.processors.sessions import SessionRule, Sessions
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import KeyIds, results_frame
from shoal.schemas.results import RETRACTED

Int64Array = npt.NDArray[np.int64]

NOT_PUBLISHED: Final = np.iinfo(np.int64).min
"""``_Entries.pub`` of an entry whose session has not been published under its start."""
COMPACT_PIECES: Final = 2_000_000
"""Pending pieces (plus their sketch cells) that trigger a merge between closes."""
MAX_SESSION_CHUNKS: Final = 16
"""Chunks of merged sessions a window holds at most before they become one."""
_EVER: Final = 2**62


@dataclass
class _Entries:
    """Session entries of one window: pieces, or sessions once merged.

    ``cells`` are sketch cells whose group is the entry's index in these arrays. ``pub``: the
    start the entry's session was last published under (``NOT_PUBLISHED``: never, as is).
    """

    key: Int64Array
    first: Int64Array
    last: Int64Array
    fields: dict[str, npt.NDArray[Any]]
    cells: Int64Array
    counts: Int64Array
    pub: Int64Array

    def __len__(self) -> int:
        return len(self.first)

    def take(self, picked: npt.NDArray[np.bool_]) -> _Entries:
        """The entries where ``picked`` (cells re-indexed, still sorted when they were)."""
        index = np.cumsum(picked) - 1
        owner = cell_groups(self.cells)
        keep = picked[owner] if len(owner) else np.zeros(0, dtype=np.bool_)
        return _Entries(
            self.key[picked],
            self.first[picked],
            self.last[picked],
            {f: c[picked] for f, c in self.fields.items()},
            cell_ids(index[owner[keep]], cell_buckets(self.cells[keep])),
            self.counts[keep],
            self.pub[picked],
        )


class _Reach:
    """Which sessions pieces could join: of a key with pieces, less than a gap from them.

    A superset (a key's pieces are taken as one span from their first to their last): a
    session outside it is further than ``gap_ms`` from every piece of its key, and from
    every session that one could join (sessions of a key are a gap apart), so a merge leaves
    it as it is.
    """

    def __init__(self, pieces: _Entries, gap_ms: int) -> None:
        size = int(pieces.key.max(initial=-1)) + 1
        self.first = np.full(size, _EVER, dtype=np.int64)
        self.last = np.full(size, -_EVER, dtype=np.int64)
        np.minimum.at(self.first, pieces.key, pieces.first - gap_ms)
        np.maximum.at(self.last, pieces.key, pieces.last + gap_ms)

    def of(self, sessions: _Entries) -> npt.NDArray[np.bool_]:
        """Per session, whether a piece could join it."""
        if len(self.first) == 0:
            return np.zeros(len(sessions), dtype=np.bool_)
        key = np.minimum(sessions.key, len(self.first) - 1)  # keys without pieces: masked
        return (
            (sessions.key < len(self.first))
            & (sessions.last > self.first[key])
            & (sessions.first < self.last[key])
        )


def _concat(chunks: list[_Entries]) -> _Entries:
    if len(chunks) == 1:
        return chunks[0]
    offsets = np.cumsum([0, *(len(c) for c in chunks[:-1])])
    return _Entries(
        np.concatenate([c.key for c in chunks]),
        np.concatenate([c.first for c in chunks]),
        np.concatenate([c.last for c in chunks]),
        {f: np.concatenate([c.fields[f] for c in chunks]) for f in chunks[0].fields},
        np.concatenate(
            [
                cell_ids(cell_groups(c.cells) + int(o), cell_buckets(c.cells))
                for c, o in zip(chunks, offsets.tolist(), strict=True)
            ]
        ),
        np.concatenate([c.counts for c in chunks]),
        np.concatenate([c.pub for c in chunks]),
    )


@dataclass
class SessionClose:
    """What ``SessionState.close_keeping`` published in one step.

    ``revisions``: (window name, start) -> revision, for the messages above revision 1.
    """

    frame: pl.DataFrame | None
    revisions: dict[tuple[str, int], int]
    closed: int = 0
    """Messages published for the first time."""
    corrections: int = 0
    """Messages published again (revision above 1)."""


class SessionState:
    """Open sessions of every session window of one partition (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, plan: AggregatePlan, keys: KeyIds) -> None:
        self.spec = spec
        self.plan = plan
        self.keys = keys
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self.rules: dict[int, SessionRule] = {}
        for index, window in enumerate(spec.windows):
            rule = session_rule(window)
            if rule is not None:
                self.rules[index] = rule
        # Per window: chunks of merged sessions (the first ``_held``; no session of one could
        # join a session of another), then chunks of pieces as partials brought them.
        self._chunks: dict[int, list[_Entries]] = {w: [] for w in self.rules}
        self._held: dict[int, int] = dict.fromkeys(self.rules, 0)
        self._pending = 0
        self._reset_corrections()

    def _reset_corrections(self) -> None:
        self.published: dict[tuple[int, int], int] = {}
        """(window, start) -> the revision last published (kept sessions' messages)."""
        self.dirty: set[tuple[int, int]] = set()
        """Published messages whose content changed since (``close_keeping``)."""
        self.retracted: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        """(window, old start) -> key id -> (new start, new end): sessions that moved."""

    @property
    def windows(self) -> frozenset[int]:
        """Indices (in the spec) of the session windows."""
        return frozenset(self.rules)

    def open_sessions(self) -> int:
        """Entries held (sessions, and pieces not merged yet)."""
        return sum(len(c) for chunks in self._chunks.values() for c in chunks)

    def held_cells(self) -> int:
        """State cells held (``max_state_cells``): entries and their sketch cells."""
        return sum(len(c) + len(c.cells) for chunks in self._chunks.values() for c in chunks)

    # -- input -------------------------------------------------------------------------------

    def add(
        self, rows: PartialRows, keep: npt.NDArray[np.bool_], pub: Int64Array | None = None
    ) -> None:
        """Append the session pieces of a partial picked by ``keep`` (their sketch follows).

        ``pub``: per row, the start it was published under (a checkpoint's; else none was).
        """
        if rows.last is None or not keep.any():
            return
        for window in self.rules:
            taken = np.flatnonzero(keep & (rows.window == window))
            if len(taken) == 0:
                continue
            cells, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
            if rows.sketch_row is not None and self.plan.needs_sketch:
                assert rows.sketch_bucket is not None
                assert rows.sketch_count is not None
                entry_of_row = np.full(len(rows), -1, dtype=np.int64)
                entry_of_row[taken] = np.arange(len(taken))
                owner = entry_of_row[rows.sketch_row]
                used = owner >= 0
                cells = cell_ids(owner[used], rows.sketch_bucket[used])
                counts = rows.sketch_count[used]
            self._chunks[window].append(
                _Entries(
                    self.keys.key_ids([rows.keys[i] for i in taken.tolist()]),
                    rows.start[taken],
                    rows.last[taken],
                    {f: rows.fields[f][taken] for f in self.plan.field_names},
                    cells,
                    counts,
                    np.full(len(taken), NOT_PUBLISHED, dtype=np.int64)
                    if pub is None
                    else pub[taken],
                )
            )
            self._pending += len(taken) + len(cells)
        if self._pending >= COMPACT_PIECES:
            self.compact()

    def compact(self) -> None:
        """Merge every window's pieces into sessions (one entry per session)."""
        for window in self.rules:
            self._merge(window)
        self._pending = 0

    def _merge(self, window: int) -> _Entries | None:
        """The window's sessions as one chunk, one entry each (None: none held)."""
        chunks = self._settle(window)
        if not chunks:
            return None
        if len(chunks) > 1:
            self._keep(window, [_concat(chunks)])
        return self._chunks[window][0]

    def _settle(self, window: int) -> list[_Entries]:
        """Merge the window's pieces into its sessions; the chunks of sessions.

        Only the sessions that a piece could join are merged again, into a new chunk with the
        pieces; the rest stay in their chunks as they are. Merging and copying every session
        held at every close cost the combiner its time at 100,000 keys, where a close takes
        only the few sessions that end (docs/benchmarks.md, "Session windows at 100,000
        keys, session 11"). When most sessions are touched, or chunks pile up, all become one chunk.
        """
        chunks, held = self._chunks[window], self._held[window]
        if held == len(chunks):
            return chunks
        sessions, pieces = chunks[:held], _concat(chunks[held:])
        near = _Reach(pieces, self.rules[window].gap_ms)
        touched = [near.of(c) for c in sessions]
        count = sum(int(t.sum()) for t in touched)
        if 2 * count >= sum(len(c) for c in sessions) or len(sessions) >= MAX_SESSION_CHUNKS:
            kept = [self._merge_pieces(window, _concat(chunks))]
        else:
            joining = [c.take(t) for c, t in zip(sessions, touched, strict=True) if t.any()]
            kept = [
                c if not t.any() else c.take(~t)
                for c, t in zip(sessions, touched, strict=True)
                if not t.all()
            ]
            kept.append(self._merge_pieces(window, _concat([*joining, pieces])))
        self._keep(window, kept)
        return kept

    def _keep(self, window: int, sessions: list[_Entries]) -> None:
        """Hold ``sessions`` (chunks of merged sessions) as the window's whole state."""
        self._chunks[window] = sessions
        self._held[window] = len(sessions)

    def _merge_pieces(self, window: int, entries: _Entries) -> _Entries:
        """Sessions of ``entries`` (pieces, and sessions of the same keys): one entry each."""
        sessions = self.rules[window].merge_intervals(entries.key, entries.first, entries.last)
        labels, fields = merge_state(sessions.label, entries.fields, self.plan.fields)
        del labels  # 0 .. len(sessions) - 1: session i is label i
        cells, counts = entries.cells, entries.counts
        if len(cells):
            owner = sessions.label[cell_groups(cells)]
            # sorted runs (the merged base, then each chunk): the sort path beats a dense grid
            cells, counts = merge_cells(cell_ids(owner, cell_buckets(cells)), counts)
        pub = np.full(len(sessions), NOT_PUBLISHED, dtype=np.int64)
        published = entries.pub != NOT_PUBLISHED
        if published.any():
            self._note_changes(window, entries, sessions, published)
            same = published & (entries.pub == sessions.first_ts[sessions.label])
            pub[sessions.label[same]] = entries.pub[same]
        return _Entries(
            sessions.key, sessions.first_ts, sessions.last_ts, fields, cells, counts, pub
        )

    def _note_changes(
        self,
        window: int,
        entries: _Entries,
        sessions: Sessions,
        published: npt.NDArray[np.bool_],
    ) -> None:
        """Mark the published messages a merge changes (``dirty``) and the moves (retractions).

        A published session that took in another entry changed; one whose start moved lost
        its place in the message of its old start.
        """
        sizes = np.bincount(sessions.label, minlength=len(sessions))
        new_first = sessions.first_ts[sessions.label]
        moved = published & (entries.pub != new_first)
        grown = published & (sizes[sessions.label] > 1)
        gap = self.rules[window].gap_ms
        for i in np.flatnonzero(moved | grown).tolist():
            label = int(sessions.label[i])
            first = int(new_first[i])
            old = int(entries.pub[i])
            self.dirty.add((window, first))
            if old != first:
                self.dirty.add((window, old))
                end = int(sessions.last_ts[label]) + gap
                self.retracted.setdefault((window, old), {})[int(entries.key[i])] = (first, end)

    # -- closing ----------------------------------------------------------------------------

    def close(self, threshold: int) -> pl.DataFrame | None:
        """Take out and finalise the sessions the threshold lets close (None: none).

        A session closes when ``last + 2 * gap_ms <= threshold`` and no open session of the
        same window has its start (see the module docstring).
        """
        frames = []
        for window, rule in self.rules.items():
            chunks = self._chunks[window]
            reach = min((int(c.last.min()) for c in chunks if len(c)), default=None)
            if reach is None or reach + 2 * rule.gap_ms > threshold:
                continue  # merging only makes ``last`` larger: nothing can close
            held = self._settle(window)
            ends = [c.last + 2 * rule.gap_ms <= threshold for c in held]
            if not any(e.any() for e in ends):
                continue
            # A session waits while an open one has its start: only those starting before
            # the last closable one can.
            latest = max(
                int(c.first[e].max(initial=-_EVER)) for c, e in zip(held, ends, strict=True)
            )
            waits = np.concatenate(
                [c.first[~e & (c.first <= latest)] for c, e in zip(held, ends, strict=True)]
            )
            if len(waits):
                for c, e in zip(held, ends, strict=True):
                    candidates = np.flatnonzero(e)
                    e[candidates[np.isin(c.first[candidates], waits)]] = False
            pairs = list(zip(held, ends, strict=True))
            done = [c if e.all() else c.take(e) for c, e in pairs if e.any()]
            if not done:
                continue
            frames.append(self._finish(window, rule, _concat(done)))
            self._keep(window, [c if not e.any() else c.take(~e) for c, e in pairs if not e.all()])
        if not frames:
            return None
        return frames[0] if len(frames) == 1 else pl.concat(frames)

    def close_keeping(self, threshold: int | None, allowed_ms: int) -> SessionClose:
        """``close`` with allowed lateness: publish, keep closed sessions, publish corrections.

        A message (window, start) is published when every session with that start may close
        (``last + 2 * gap_ms <= threshold``) and it is new or ``dirty``; it holds those
        sessions and the retractions of sessions that moved away from that start. Published
        sessions are then forgotten once the threshold passes their close by ``allowed_ms``.
        """
        frames: list[pl.DataFrame] = []
        out = SessionClose(None, {})
        for window, rule in self.rules.items():
            entries = self._merge(window)
            if entries is None:
                continue
            closable = (
                np.zeros(len(entries), dtype=np.bool_)
                if threshold is None
                else entries.last + 2 * rule.gap_ms <= threshold
            )
            ready = {
                *entries.first[closable & (entries.pub == NOT_PUBLISHED)].tolist(),
                *(s for w, s in self.dirty if w == window),
            }
            ready -= set(entries.first[~closable].tolist())
            if ready:
                starts = np.array(sorted(ready), dtype=np.int64)
                taking = closable & np.isin(entries.first, starts)
                frame = self._finish(window, rule, entries.take(taking))
                frame = self._with_retractions(window, rule, frame, starts, entries)
                frames.append(frame)
                entries.pub[taking] = entries.first[taking]
                name = self.spec.windows[window].name
                for start in starts.tolist():
                    self.dirty.discard((window, start))
                for start in frame["start"].unique(maintain_order=True).to_list():
                    revision = self.published.get((window, start), 0) + 1
                    self.published[(window, start)] = revision
                    if revision > 1:
                        out.revisions[(name, start)] = revision
                        out.corrections += 1
                    else:
                        out.closed += 1
            if threshold is not None:
                self._drop(window, rule, entries, threshold - allowed_ms)
        if frames:
            out.frame = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal")
        return out

    def _with_retractions(
        self,
        window: int,
        rule: SessionRule,
        frame: pl.DataFrame,
        starts: Int64Array,
        entries: _Entries,
    ) -> pl.DataFrame:
        """``frame`` with the retractions of the messages of ``starts`` (taken out of the map).

        A retraction row has the moved session's key, ``rows`` and ``batches`` 0, null
        aggregates (``count`` 0), and ``superseded_by``/``end``: where the key's session is
        now (its current entry holding the old start, else the one noted at the move).
        """
        rows: list[tuple[int, int, int, int]] = []  # (old start, key id, new start, new end)
        for start in starts.tolist():
            for key, (first, end) in self.retracted.pop((window, start), {}).items():
                holder = np.flatnonzero(
                    (entries.key == key) & (entries.first <= start) & (entries.last >= start)
                )
                if len(holder) == 0:  # dropped since: where it was at the move
                    rows.append((start, key, first, end))
                    continue
                h = int(holder[0])
                rows.append((start, key, int(entries.first[h]), int(entries.last[h]) + rule.gap_ms))
        if not rows:
            return frame
        rows.sort()
        keys = self.keys.keys_of(np.array([r[1] for r in rows], dtype=np.int64))
        zeros = np.zeros(len(rows), dtype=np.int64)
        head = pl.DataFrame(
            {
                "window": [self.spec.windows[window].name] * len(rows),
                "start": np.array([r[0] for r in rows], dtype=np.int64),
                "end": np.array([r[3] for r in rows], dtype=np.int64),
                "key": keys,
                "rows": zeros,
                "batches": zeros,
                **({"count": zeros} if "count" in frame.columns else {}),
                RETRACTED: np.array([r[2] for r in rows], dtype=np.int64),
            }
        )
        tombstones = pl.concat([frame.clear(), head], how="diagonal_relaxed")
        merged = pl.concat([frame, tombstones], how="diagonal_relaxed")
        return merged.sort("start", maintain_order=True)

    def _drop(self, window: int, rule: SessionRule, entries: _Entries, through: int) -> None:
        """Forget published sessions closed at or before ``through`` (and their counts)."""
        gone = (entries.pub != NOT_PUBLISHED) & (entries.last + 2 * rule.gap_ms <= through)
        if gone.any():
            self._keep(window, [entries.take(~gone)])
            entries = self._chunks[window][0]
        held = set(entries.first.tolist())
        for w, start in [k for k in self.published if k[0] == window]:
            if start + rule.gap_ms <= through and start not in held:
                del self.published[(w, start)]

    def reach(self) -> int | None:
        """The close threshold at which every session held may close (None: none held)."""
        ends = [
            int(c.last.max()) + 2 * rule.gap_ms
            for window, rule in self.rules.items()
            for c in self._chunks[window]
            if len(c)
        ]
        return max(ends, default=None)

    def kept(self) -> int:
        """Closed (published) sessions held for corrections."""
        return sum(
            int((c.pub != NOT_PUBLISHED).sum()) for chunks in self._chunks.values() for c in chunks
        )

    def close_all(self) -> tuple[pl.DataFrame | None, int | None]:
        """Close every session (a flush); also the close threshold that covers them.

        The threshold (largest ``last + 2 * gap_ms``) makes every later piece that could
        have reached a flushed session late (``window_closed``).
        """
        through = None
        for window, rule in self.rules.items():
            entries = self._merge(window)
            if entries is not None and len(entries):
                reach = int(entries.last.max()) + 2 * rule.gap_ms
                through = reach if through is None else max(through, reach)
        return self.close(_EVER), through

    def _finish(self, window: int, rule: SessionRule, done: _Entries) -> pl.DataFrame:
        order = np.lexsort((done.key, done.first))  # by start, then key: one run per message
        index = np.arange(len(done))
        quantiles: list[npt.NDArray[np.float64]] = []
        if self.plan.needs_sketch:
            wanted = list(self.plan.quantiles.values())
            quantiles = QUANTILES.finalize(self.buckets, done.cells, done.counts, index, wanted)
        head = {
            "window": [self.spec.windows[window].name] * len(done),
            "start": done.first,
            "end": done.last + rule.gap_ms,
            "key": self.keys.keys_of(done.key),
        }
        frame = results_frame(self.spec, self.plan, head, done.fields, quantiles)
        return frame[order]

    # -- checkpoints -------------------------------------------------------------------------

    def snapshot_rows(self) -> PartialRows | None:
        """The merged sessions in the partials' layout (``last`` included), for a checkpoint."""
        self.compact()
        parts = [(w, c[0]) for w, c in self._chunks.items() if c and len(c[0])]
        if not parts:
            return None
        entries = _concat([e for _, e in parts])
        window = np.concatenate([np.full(len(e), w, dtype=np.uint8) for w, e in parts])
        with_sketch = self.plan.needs_sketch
        return PartialRows(
            window=window,
            start=entries.first,
            keys=self.keys.keys_of(entries.key).to_list(),
            fields=entries.fields,
            sketch_row=cell_groups(entries.cells) if with_sketch else None,
            sketch_bucket=cell_buckets(entries.cells) if with_sketch else None,
            sketch_count=entries.counts if with_sketch else None,
            last=entries.last,
        )

    def snapshot_corrections(self) -> dict[str, Any] | None:
        """What corrections need beyond ``snapshot_rows`` (None: nothing published is kept).

        ``pub`` follows ``snapshot_rows``' order; retractions name their keys.
        """
        self.compact()
        pub = [c[0].pub for c in self._chunks.values() if c and len(c[0])]
        if not self.published and not self.retracted and not self.dirty:
            return None
        return {
            "pub": np.concatenate(pub).tolist() if pub else [],
            "published": [[w, s, n] for (w, s), n in sorted(self.published.items())],
            "dirty": [[w, s] for w, s in sorted(self.dirty)],
            "retracted": [
                [w, s, name, first, end]
                for (w, s), moved in sorted(self.retracted.items())
                for name, (first, end) in zip(
                    self.keys.keys_of(np.array(list(moved), dtype=np.int64)).to_list(),
                    moved.values(),
                    strict=True,
                )
            ],
        }

    def restore(self, rows: PartialRows | None, corrections: dict[str, Any] | None = None) -> None:
        """Replace the sessions with a snapshot's rows (after the key registry's restore)."""
        self._chunks = {w: [] for w in self.rules}
        self._held = dict.fromkeys(self.rules, 0)
        self._pending = 0
        self._reset_corrections()
        if corrections is not None:
            self.published = {(w, s): n for w, s, n in corrections["published"]}
            self.dirty = {(w, s) for w, s in corrections["dirty"]}
            for w, s, name, first, end in corrections["retracted"]:
                key = int(self.keys.key_ids([name])[0])
                self.retracted.setdefault((w, s), {})[key] = (first, end)
        if rows is not None and len(rows):
            pub = None if corrections is None else np.array(corrections["pub"], dtype=np.int64)
            self.add(rows, np.ones(len(rows), dtype=np.bool_), pub)
            self.compact()
