"""Open windows of one combiner partition: merged partial state, closing and finalising.

State lives in numpy arrays keyed by an int64 group id ``slot << KEY_BITS | key_id``: a *slot*
is one open (window, start), a *key id* one result key. Sketch buckets are cells
``group << BUCKET_BITS | bucket``. Partials are appended cheaply and merged lazily (sorted
``reduceat`` passes in ``_kernels``): when enough rows are pending, or when windows close.
Merging is associative and commutative, so state is always exactly "the merge of everything
applied", whatever the order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import ConfigError, SchemaError
from shoal.processors._kernels import (
    BUCKET_BITS,
    FieldKernels,
    add_cells,
    cell_buckets,
    cell_groups,
    cell_ids,
    gather_runs,
    merge_cells,
    merge_pair,
    merge_state,
)
from shoal.processors._stacks import Keyed, PaneStacks
from shoal.processors.aggregates import (
    BATCHES,
    LAST_TS,
    PANE_CONTINUED,
    QUANTILES,
    AggregatePlan,
    N,
)
from shoal.processors.partials import (
    PartialRows,
    concat_rows,
    expand_panes,
    pack_with_key_ids,
    pane_partials,
    unpack_with_key_names,
)
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec
from shoal.processors.windows import WINDOW_KINDS, kind_of
from shoal.rules import RESULT_BASE_SCHEMA
from shoal.schemas._msgpack import pack

COMPACT_ROWS: Final = 2_000_000
"""Pending rows (state + sketch) that trigger a merge: bounds memory between window closes."""

TIDY_SHARE: Final = 4
"""Between closes, pending rows are merged once they are 1/``TIDY_SHARE`` of all rows held
(``WindowState.tidy``)."""

INSERT_SHARE: Final = 4
"""``compact`` inserts pending rows into the merged base (no re-sort) while they are fewer than
1/``INSERT_SHARE`` of it."""

PREPARE_BACKOFF: Final = 8
"""Pane windows are not finalised ahead (``prepare``) for this many closes after a close whose
prepared results a row had made stale."""

PACKED_NAME_CHUNKS: Final = 64
"""Chunks of packed key names kept for checkpoints before they are packed afresh as one."""

KEY_LIST_CACHE: Final = 256
"""Key lists remembered (about one per gateway and window)."""

KEY_BITS: Final = 24
"""Key ids per partition: up to 16.7 million distinct keys."""
SLOT_LIMIT: Final = 1 << (63 - KEY_BITS - BUCKET_BITS)
"""Open (window, start) pairs at once: 32,768."""


class KeyIds:
    """A partition's key ids: dense, in order of first sight, never reused.

    ``WindowState`` keeps one for the aligned windows and shares it with ``SessionState``;
    ``CountState`` keeps its own (count windows never share a pipeline with time windows).
    """

    def __init__(self, names: list[str | None] | None = None) -> None:
        self.names: list[str | None] = []
        self._ids: dict[str | None, int] = {}
        self._lists: dict[str | tuple[str | None, ...], npt.NDArray[np.int64]] = {}
        self.clear(names)

    def __len__(self) -> int:
        return len(self.names)

    def clear(self, names: list[str | None] | None = None) -> None:
        """Forget every key (or start from ``names``, id ``i`` for ``names[i]``)."""
        self.names = [] if names is None else list(names)
        self._ids = {k: i for i, k in enumerate(self.names)}
        self._lists = {}
        self._packed: list[bytes] = []
        self._packed_count = 0

    def packed_names(self) -> list[bytes]:
        """The names in id order, as MsgPack arrays to read in turn (``unpack_names``).

        Names only ever get added: each call packs the names added since the last one, so a
        checkpoint pays for new keys only.
        """
        if self._packed_count < len(self.names):
            if len(self._packed) >= PACKED_NAME_CHUNKS:
                self._packed, self._packed_count = [], 0
            self._packed.append(pack(self.names[self._packed_count :]))
            self._packed_count = len(self.names)
        return list(self._packed)

    def key_ids(self, keys: list[str | None]) -> npt.NDArray[np.int64]:
        """The id of each key (new keys get the next ids).

        Raises:
            ConfigError: more than ``1 << KEY_BITS`` distinct keys.
        """
        # A gateway's partials list the same keys in the same order batch after batch:
        # remember the last few lists (ids only ever grow, so a remembered list stays valid).
        signature = _signature(keys)
        known = self._lists.get(signature)
        if known is not None:
            return known
        # Looked up in one pass in C (a list not seen lately: batches sealed by age list a
        # different share of the keys each time, and at 100,000 keys a loop in Python over
        # every partial's keys was 4 % of a sliding combiner's main thread); new keys then
        # get ids in the order of their first row, as before.
        ids = self._ids
        found = list(map(ids.get, keys))
        if None in found:
            for i, key in enumerate(keys):
                if found[i] is not None:
                    continue
                key_id = ids.get(key)
                if key_id is None:
                    key_id = len(self.names)
                    if key_id >= 1 << KEY_BITS:
                        raise ConfigError(
                            f"more than {1 << KEY_BITS} distinct keys in one partition"
                        )
                    ids[key] = key_id
                    self.names.append(key)
                found[i] = key_id
        out = np.array(found, dtype=np.int64)
        if len(self._lists) >= KEY_LIST_CACHE:
            self._lists.pop(next(iter(self._lists)))
        self._lists[signature] = out
        return out

    def keys_of(self, ids: npt.NDArray[np.integer[Any]]) -> pl.Series:
        """The keys of key ids (a ``key`` column)."""
        names = pl.Series("key", self.names, dtype=pl.String)
        return names.gather(pl.Series(ids, dtype=pl.UInt32))


def _signature(keys: list[str | None]) -> str | tuple[str | None, ...]:
    """What identifies a key list, cheap to hash and compare: the keys joined by NUL.

    One string, hashed and compared in one pass each: half the time of a tuple of the keys,
    whose strings are new objects in every partial (1,000 keys: ~11 us instead of ~20). Two
    lists join alike only if some key holds a NUL, so when one does (or a key is None, or
    there is none), the tuple is the signature: it never equals a string.
    """
    if not keys:
        return ()  # not "", which is also the signature of [""]
    try:
        joined = "\0".join(keys)  # type: ignore[arg-type]  # a None raises TypeError
    except TypeError:
        return tuple(keys)
    # n keys without a NUL join with n - 1 of them, and split back into the same keys
    return joined if joined.count("\0") == len(keys) - 1 else tuple(keys)


@dataclass(frozen=True, slots=True)
class ClosedWindows:
    """Final results of the windows that closed in one step.

    ``frame`` has ``window`` (name), ``start``, ``end``, ``key``, ``rows``, ``batches`` and
    one column per requested aggregate, sorted by window, start and key.
    """

    frame: pl.DataFrame
    revisions: Mapping[tuple[str, int], int] = field(default_factory=dict)
    """(window name, start) -> revision, for windows whose revision is above 1 (corrections)."""
    sessions: frozenset[str] = frozenset()
    """Names of the session windows: their results keep a per-key ``end`` (``split_windows``)."""

    @property
    def empty(self) -> bool:
        """Whether nothing closed."""
        return self.frame.height == 0


class WindowState:
    """Merged state of every open (window, start, key) of one partition.

    Windows whose partials carry panes (``partials.pane_partials``: sliding windows) keep
    state per (pane, key) in a second ``WindowState`` (``panes``), whose slots are
    (window, pane start) and whose ``end`` is the pane's newest window's end (when the pane
    is no longer needed); a window of such a kind is the merge of the state of its own slot
    (rows a combiner expanded from panes, see ``Combiner``) and of its ``size/step`` panes,
    assembled when it is finalised (``_finish_windows``). Windows ending at or before
    ``pane_forgotten`` are closed (or dropped): panes still held for newer windows do not
    bring them back.
    """

    def __init__(self, spec: PipelineSpec, plan: AggregatePlan) -> None:
        self.spec = spec
        self.plan = plan
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self._fields = plan.field_names
        self._sizes = np.array([w.size_ms for w in spec.windows], dtype=np.int64)
        self._slides = np.array([w.slide_ms for w in spec.windows], dtype=np.int64)
        self._names = [w.name for w in spec.windows]
        self._triggered = spec.needs_last_ts
        self._empty: pl.DataFrame | None = None
        self.keys = KeyIds()
        """The partition's key ids (``SessionState`` shares them)."""
        self._pane_mode = np.array(pane_partials(spec), dtype=bool)
        self.panes: PaneState | None = None
        """State per (pane, key) of the windows whose partials carry panes (None: none)."""
        self._stacks: PaneStacks | None = None
        """Prefixes and suffixes of pane blocks that windows are assembled from (``_stacks``)."""
        if self._pane_mode.any():
            pane_plan = replace(plan, fields=(*plan.fields, PANE_CONTINUED))
            self.panes = PaneState(spec, pane_plan, self.keys)
            self._stacks = PaneStacks(pane_plan.fields)
        self.pane_forgotten: int | None = None
        """Windows ending at or before this were closed or dropped (pane windows only)."""
        self._reset()

    def _reset(self) -> None:
        self.keys.clear()
        if self.panes is not None:
            self.panes.clear()
        if self._stacks is not None:
            self._stacks.clear()
        self.pane_forgotten = None
        self._slots: dict[tuple[int, int], int] = {}
        self._slot_info: dict[int, tuple[int, int, int]] = {}  # slot -> (window, start, end)
        self._free_slots: list[int] = []
        self._groups: list[npt.NDArray[np.int64]] = []
        self._columns: list[dict[str, npt.NDArray[Any]]] = []
        self._cells: list[npt.NDArray[np.int64]] = []
        self._counts: list[npt.NDArray[np.int64]] = []
        self._pending_rows = 0
        self._groups_merged = False
        self._cells_merged = False
        self._prepared: _Prepared | None = None
        self._prepared_lost = False  # a row reached the prepared windows (panes)
        self._prepare_skips = 0
        self._pane_blobs: dict[tuple[int, int], bytes] = {}
        """Per held pane (window, start), its packed state as of the last ``snapshot_panes``."""

    @property
    def rows(self) -> int:
        """State rows held (merged and pending, sketch cells included; panes too)."""
        held = sum(len(g) for g in self._groups) + sum(len(c) for c in self._cells)
        return held + (0 if self.panes is None else self.panes.rows)

    @property
    def pending_rows(self) -> int:
        """Rows appended since the last merge (panes too)."""
        return self._pending_rows + (0 if self.panes is None else self.panes.pending_rows)

    def open_windows(self) -> int:
        """Distinct (window, start) pairs with state."""
        if self.panes is None:
            return len(self._slots)
        return len(self._held_windows(None, None))

    # -- input -------------------------------------------------------------------------------

    def add(self, rows: PartialRows, keep: npt.NDArray[np.bool_] | None = None) -> None:
        """Append a partial's state rows (``keep``: which rows to take; sketch follows).

        The rows' own arrays are kept until the next merge, not copied (read-only ones from
        the partial's message; merging only reads pending chunks). Rows not kept (late ones,
        those of session windows) are left out first (``PartialRows.take``).
        """
        if keep is not None and not keep.all():
            rows = rows.take(np.flatnonzero(keep))
        if len(rows) == 0:
            return
        slots = self._slot_ids(rows.window.astype(np.int64), rows.start)
        if self._prepared is not None and np.isin(slots, self._prepared.slots).any():
            self._prepared = None  # a late row for a prepared window: finalise it again
            self._prepared_lost = True
        groups = (slots << KEY_BITS) | self.keys.key_ids(rows.keys)
        self._groups.append(groups)
        self._columns.append({f: rows.fields[f] for f in self._fields})
        self._pending_rows += len(groups)
        if rows.sketch_row is not None and self.plan.needs_sketch:
            assert rows.sketch_bucket is not None
            assert rows.sketch_count is not None
            self._cells.append(cell_ids(groups[rows.sketch_row], rows.sketch_bucket))
            self._counts.append(rows.sketch_count)
            self._pending_rows += len(rows.sketch_row)
        if self._pending_rows >= COMPACT_ROWS:
            self.compact()

    def take_panes(
        self, rows: PartialRows, on_time: Callable[[npt.NDArray[np.int64]], bool]
    ) -> tuple[PartialRows | None, int]:
        """Take one batch's pane rows (``pane_partials``) into the pane state if they can.

        They can when ``on_time`` (given the end of each pane's oldest window, a step after
        the pane's start) says every window of every pane still takes rows, and no key has
        two panes 2 to ``fan - 1`` apart (a window could hold both without the panes between).
        Each batch's run of consecutive panes of a key is then counted once per window
        (``PANE_CONTINUED``). Otherwise the pane rows are expanded into the window rows a
        worker sends for a hopping window (``partials.expand_panes``), and the caller judges
        lateness and corrections for each window as ever.

        Returns the rows left to the caller (those of other windows, and expanded ones; None:
        none) and how many window memberships (rows times windows) went into the pane state.
        """
        window = rows.window.astype(np.int64)
        is_pane = self._pane_mode[window]
        if self.panes is None or not is_pane.any():
            return rows, 0
        panes, others = rows, None
        if not is_pane.all():
            panes = rows.take(np.flatnonzero(is_pane))
            others = rows.take(np.flatnonzero(~is_pane))
        pane_window = window[is_pane]
        slide = self._slides[pane_window]
        fan = self._sizes[pane_window] // slide
        continued = None
        if on_time(panes.start + slide):
            key_ids = self.keys.key_ids(panes.keys)
            continued = _continued(panes.start, pane_window, key_ids, slide, fan)
        if continued is None:
            expanded = expand_panes(panes, self.spec, self.plan.fields)
            return (expanded if others is None else concat_rows([others, expanded])), 0
        batches = panes.fields[BATCHES.name]
        fields = {
            **panes.fields,
            BATCHES.name: np.where(continued, 0, batches),
            PANE_CONTINUED.name: np.where(continued, batches, 0),
        }
        self._add_panes(replace(panes, fields=fields), key_ids)
        return others, int((panes.fields[N.name] * fan).sum())

    def _add_panes(self, rows: PartialRows, key_ids: npt.NDArray[np.int64]) -> None:
        """Append pane rows (``start``: the pane's; fields with ``continued``; their key ids)."""
        assert self.panes is not None
        prepared = self._prepared
        if prepared is not None:
            # a pane of a prepared window (a gateway behind the others): finalise it again
            size = self._sizes[rows.window.astype(np.int64)]
            for w, s in prepared.windows:
                if ((rows.window == w) & (rows.start >= s) & (rows.start < s + size)).any():
                    self._prepared = None
                    self._prepared_lost = True
                    break
        self.panes.add(rows, key_ids)

    def _slot_ids(
        self, window: npt.NDArray[np.int64], start: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        # (window, start) packed into one int64: start < 2**55 ms (the contract caps ts at 2**53).
        pairs = (window << 55) | (start + 2**54)
        if len(pairs) and (pairs == pairs[0]).all():  # one window: a batch of a few ms
            unique, inverse = pairs[:1], np.zeros(len(pairs), dtype=np.intp)
        else:
            unique, inverse = np.unique(pairs, return_inverse=True)
        ids = np.empty(len(unique), dtype=np.int64)
        for i, packed in enumerate(unique.tolist()):
            w, s = packed >> 55, (packed & (2**55 - 1)) - 2**54
            slot = self._slots.get((w, s))
            if slot is None:
                slot = self._free_slots.pop() if self._free_slots else len(self._slot_info)
                if slot >= SLOT_LIMIT:
                    raise ConfigError(
                        f"more than {SLOT_LIMIT} windows open at once; shorten lateness_ms or "
                        "use larger slides"
                    )
                self._slots[(w, s)] = slot
                self._slot_info[slot] = (w, s, s + int(self._sizes[w]))
            ids[i] = slot
        result: npt.NDArray[np.int64] = ids[inverse.reshape(-1)]
        return result

    def tidy(self) -> None:
        """Merge pending rows between messages once they are a sizeable share of the state.

        A merge sorts everything held, pending and merged alike: merging after every partial
        or two (a combiner's tick) would cost the whole state each time. Merging once the
        pending rows are 1/``TIDY_SHARE`` of all rows costs a bounded multiple of what was
        appended, and keeps at most that share unmerged. Closing needs none of it: a
        window is finalised ahead (``prepare``) and its rows are taken from merged and
        pending chunks alike (``close``).
        """
        if self._pending_rows and self._pending_rows * TIDY_SHARE >= self.rows:
            self.compact()

    def compact(self) -> None:
        """Merge all pending state into one sorted set of arrays (the form ``close`` needs).

        Sketch cells pending next to an already merged base are merged among themselves and
        inserted into it (``add_cells``), however many: the base is never sorted again, and
        the merge allocates about the base's size (the old base and the new one), not a
        multiple of everything held (docs/benchmarks.md, "The combiner's sketch cells merged
        by sorting and inserting").
        """
        if self.panes is not None:
            self.panes.compact()
        if self._pending_rows == 0:
            return
        if self._groups:
            groups = np.concatenate(self._groups[1:] if self._groups_merged else self._groups)
            columns = {
                f: np.concatenate([c[f] for c in self._columns[self._groups_merged :]])
                for f in self._fields
            }
            if self._groups_merged and len(groups) * INSERT_SHARE < len(self._groups[0]):
                merged_groups, merged = _insert_state(
                    self._groups[0], self._columns[0], groups, columns, self.plan.fields
                )
            else:
                if self._groups_merged:  # the merged base first: the same order as above
                    groups = np.concatenate((self._groups[0], groups))
                    columns = {
                        f: np.concatenate((self._columns[0][f], c)) for f, c in columns.items()
                    }
                merged_groups, merged = merge_state(groups, columns, self.plan.fields)
            self._groups, self._columns = [merged_groups], [merged]
            self._groups_merged = True
        base = 1 if self._cells_merged else 0  # the merged base's chunk, if there is one
        if len(self._cells) > base:
            empty = np.empty(0, dtype=np.int64)
            cells, counts = add_cells(
                self._cells[0] if base else empty,
                self._counts[0] if base else empty,
                np.concatenate(self._cells[base:]),
                np.concatenate(self._counts[base:]),
            )
            self._cells, self._counts = [cells], [counts]
            self._cells_merged = True
        self._pending_rows = 0

    # -- closing ----------------------------------------------------------------------------

    def next_end(self) -> int | None:
        """The earliest window end among held windows (None: nothing held)."""
        if self.panes is not None:
            return min(
                (s + int(self._sizes[w]) for w, s in self._held_windows(None, None)), default=None
            )
        return min((end for _, _, end in self._slot_info.values()), default=None)

    def windows_between(self, after: int | None, through: int) -> list[tuple[int, int]]:
        """(window index, start) of held windows ending in ``(after, through]``."""
        if self.panes is not None:
            return self._held_windows(after, through)
        return sorted(
            (w, s)
            for w, s, end in self._slot_info.values()
            if end <= through and (after is None or end > after)
        )

    def windows_through(self, through: int) -> int:
        """Held windows ending at or before ``through`` (closed ones kept for corrections)."""
        if self.panes is not None:
            return len(self._held_windows(None, through))
        return sum(1 for _, _, end in self._slot_info.values() if end <= through)

    def _held_windows(self, after: int | None, through: int | None) -> list[tuple[int, int]]:
        """Held (window index, start) ending in ``(after, through]``, sorted.

        Windows with a slot of their own, and windows holding a held pane that end after
        ``pane_forgotten``.
        """
        assert self.panes is not None
        lowest = self.pane_forgotten
        if after is not None and (lowest is None or after > lowest):
            lowest = after
        held = {
            (w, s)
            for w, s, end in self._slot_info.values()
            if (through is None or end <= through) and (after is None or end > after)
        }
        for w, pane in self.panes.held():
            size, step = int(self._sizes[w]), self.spec.windows[w].slide_ms
            for s in range(pane - size + step, pane + 1, step):
                end = s + size
                if (through is None or end <= through) and (lowest is None or end > lowest):
                    held.add((w, s))
        return sorted(held)

    def peek(self, windows: list[tuple[int, int]]) -> pl.DataFrame:
        """Final results of ``windows`` ((window index, start) pairs) without removing them.

        For closed windows kept for corrections: their state stays, late rows may still
        merge into it. Windows without state give no rows.
        """
        if self.panes is not None:
            frame = self._finish_windows(windows)
            return self.empty_result() if frame is None else frame
        slots = np.array(sorted(self._slots[w] for w in windows if w in self._slots), np.int64)
        frame = self._finish_slots(slots)
        return self.empty_result() if frame is None else frame

    def _finish_windows(self, windows: list[tuple[int, int]]) -> pl.DataFrame | None:
        """Final results of ``windows`` (sorted), left in place (None: no state).

        Each is the merge of its own slot's state and, for a pane kind, of its panes'.

        Gives every pane window a slot of its own (empty until a row is expanded into it),
        so that results carry its (window, start, end) like any other; ``close`` and
        ``drop`` release them.
        """
        assert self.panes is not None
        if not windows:
            return None
        self.compact()
        wanted = np.array([w for w, _ in windows], dtype=np.int64)
        slots = self._slot_ids(wanted, np.array([s for _, s in windows], dtype=np.int64))
        groups_parts: list[npt.NDArray[np.int64]] = []
        state_parts: list[dict[str, npt.NDArray[Any]]] = []
        cells_parts: list[npt.NDArray[np.int64]] = []
        counts_parts: list[npt.NDArray[np.int64]] = []
        order = np.argsort(slots)
        if self._groups:
            rows = _slot_runs(self._groups[0], slots[order], KEY_BITS)
            groups_parts.append(self._groups[0][rows])
            state_parts.append({f: c[rows] for f, c in self._columns[0].items()})
            if self._cells:
                runs = _slot_runs(self._cells[0], slots[order], KEY_BITS + BUCKET_BITS)
                cells_parts.append(self._cells[0][runs])
                counts_parts.append(self._counts[0][runs])
        own = sum(len(g) for g in groups_parts)
        by_slot = [(int(slots[i]), *windows[i]) for i in order.tolist()]
        for slot, w, s in by_slot:
            assembled = self._from_panes(w, s, slot)
            if assembled is not None:
                groups_parts.append(assembled[0])
                state_parts.append(assembled[1])
                cells_parts.append(assembled[2])
                counts_parts.append(assembled[3])
        groups = np.concatenate(groups_parts) if groups_parts else np.zeros(0, np.int64)
        if len(groups) == 0:
            return None
        columns = {f: np.concatenate([p[f] for p in state_parts]) for f in self._fields}
        cells = np.concatenate(cells_parts) if cells_parts else np.empty(0, dtype=np.int64)
        counts = np.concatenate(counts_parts) if counts_parts else np.empty(0, dtype=np.int64)
        if own:  # rows expanded into the windows' own slots: merge them with the panes'
            groups, columns = merge_state(groups, columns, self.plan.fields)
            if len(cells):
                cells, counts = merge_cells(cells, counts)
        # else each window's panes are merged already, and in slot order they are sorted
        return self._finish(groups, columns, cells, counts)

    def _from_panes(
        self, window: int, start: int, slot: int
    ) -> (
        tuple[
            npt.NDArray[np.int64],
            dict[str, npt.NDArray[Any]],
            npt.NDArray[np.int64],
            npt.NDArray[np.int64],
        ]
        | None
    ):
        """The merged state and sketch cells of a pane window's panes, under its ``slot``.

        Assembled from prefixes and suffixes of pane blocks (``_stacks``). ``batches`` is the
        panes' (runs starting in them) plus the first pane's ``continued``. None: not a pane
        window, or its panes hold no rows.
        """
        panes, stacks = self.panes, self._stacks
        assert panes is not None
        assert stacks is not None
        if not self._pane_mode[window]:
            return None
        step = self.spec.windows[window].slide_ms
        fan = int(self._sizes[window]) // step
        keyed = stacks.window(window, start // step, fan, self._pane_lookup(window, step))
        if keyed is None or len(keyed.keys) == 0:
            return None
        groups = (slot << KEY_BITS) | keyed.keys
        state = {f: keyed.columns[f] for f in self._fields}
        state[BATCHES.name] = state[BATCHES.name] + keyed.columns[PANE_CONTINUED.name]
        cells = (slot << (KEY_BITS + BUCKET_BITS)) | keyed.cells
        return groups, state, cells, keyed.counts

    def _pane_lookup(self, window: int, step: int) -> Callable[[int], tuple[int, Keyed | None]]:
        """Pane index -> (version, merged state) of ``window``'s panes (the pane state merged)."""
        panes = self.panes
        assert panes is not None

        def lookup(index: int) -> tuple[int, Keyed | None]:
            pane = (window, index * step)
            held = panes.merged(pane)
            if held is None:
                return 0, None
            return panes.versions[pane], (held if len(held.keys) else None)

        return lookup

    def _finish_slots(self, slots: npt.NDArray[np.int64]) -> pl.DataFrame | None:
        """Final results of the windows of ``slots`` (sorted), left in place (None: no state)."""
        if len(slots) == 0:
            return None
        self.compact()  # one sorted chunk each: the windows' rows are runs of it
        if not self._groups:
            return None
        rows = _slot_runs(self._groups[0], slots, KEY_BITS)
        groups = self._groups[0][rows]
        if len(groups) == 0:
            return None
        state = {f: c[rows] for f, c in self._columns[0].items()}
        cells, counts = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if self._cells:
            runs = _slot_runs(self._cells[0], slots, KEY_BITS + BUCKET_BITS)
            cells, counts = self._cells[0][runs], self._counts[0][runs]
        return self._finish(groups, state, cells, counts)

    def drop(self, through_ms: int) -> int:
        """Forget every window ending at or before ``through_ms`` (no results); how many."""
        if self.panes is not None:
            return self._drop_with_panes(through_ms)
        dropping = [slot for slot, (_, _, end) in self._slot_info.items() if end <= through_ms]
        if not dropping:
            return 0
        self._prepared = None
        self._discard(dropping)
        return len(dropping)

    def _discard(self, slots: list[int]) -> None:
        """Remove the state rows and sketch cells of ``slots`` and release them."""
        slot_arr = np.array(sorted(slots), dtype=np.int64)
        _take_slots(
            self._groups, self._columns, KEY_BITS, slot_arr, first_sorted=self._groups_merged
        )
        counts = [{"count": c} for c in self._counts]
        _take_slots(
            self._cells, counts, KEY_BITS + BUCKET_BITS, slot_arr, first_sorted=self._cells_merged
        )
        self._counts = [c["count"] for c in counts]
        self._release(slots)

    def release_stacks(self, through_ms: int) -> None:
        """Forget the stacks only windows ending at or before ``through_ms`` need.

        Called when windows close: those kept for corrections are finalised again, rarely,
        from their panes (``_stacks`` rebuilds what it needs), instead of holding every
        block's suffixes for the allowed lateness.
        """
        if self._stacks is None:
            return
        for index, spec in enumerate(self.spec.windows):
            if self._pane_mode[index]:  # the oldest window left starts after ``through_ms``'s
                step = spec.slide_ms
                oldest = (through_ms - spec.size_ms) // step + 1
                self._stacks.prune(index, spec.size_ms // step, oldest)

    def _drop_with_panes(self, through_ms: int) -> int:
        """``drop`` with panes: windows' own slots, and panes whose windows all ended."""
        assert self.panes is not None
        held = self._held_windows(None, through_ms)
        self._prepared = None
        dropping = [slot for slot, (_, _, end) in self._slot_info.items() if end <= through_ms]
        if dropping:
            self._discard(dropping)
        self.panes.drop(through_ms)  # a pane's slot ends with its newest window
        self.release_stacks(through_ms)
        if held:
            # Not ``through_ms`` itself: after a flush (2**62) rows of later windows are
            # still on time, and their panes' windows must not count as forgotten.
            last = max(s + int(self._sizes[w]) for w, s in held)
            if self.pane_forgotten is None or last > self.pane_forgotten:
                self.pane_forgotten = last
        return len(held)

    @property
    def prepared_frame(self) -> pl.DataFrame | None:
        """Results finalised ahead of a close and still valid (``close`` will return them)."""
        return None if self._prepared is None else self._prepared.frame

    def prepare(self, through_ms: int) -> None:
        """Finalise the windows ending at or before ``through_ms`` ahead of their close.

        Called once the watermark has passed their end: from then on only late rows can
        reach them. ``close`` hands out these results unless such a row arrived meanwhile
        (then it finalises again), so a close right after the lateness costs little more
        than taking the windows' rows out of the state.
        """
        self._prepared = None
        if self.panes is not None:
            if self._prepare_skips:
                self._prepare_skips -= 1
                return
            windows = self._held_windows(None, through_ms)
            frame = self._finish_windows(windows)
            if frame is not None:
                slots = np.array(sorted(self._slots[w] for w in windows), dtype=np.int64)
                self._prepared = _Prepared(slots, frame, tuple(windows))
            return
        slots = np.array(
            sorted(slot for slot, (_, _, end) in self._slot_info.items() if end <= through_ms),
            dtype=np.int64,
        )
        frame = self._finish_slots(slots)
        if frame is not None:
            self._prepared = _Prepared(slots, frame)

    def close(self, through_ms: int) -> ClosedWindows:
        """Finalise and remove every window whose end is at or before ``through_ms``.

        Only the closing windows' rows are merged here. Every other row stays where it is
        (merged or pending), so a close costs what the closing windows hold, not what the
        open ones have gathered since the last merge.
        """
        if self.panes is not None:
            return self._close_with_panes(through_ms)
        prepared, self._prepared = self._prepared, None
        closing = [slot for slot, (_, _, end) in self._slot_info.items() if end <= through_ms]
        if not closing:
            return ClosedWindows(self.empty_result())
        closing_arr = np.array(sorted(closing), dtype=np.int64)
        taken, groups_from = _take_slots(
            self._groups, self._columns, KEY_BITS, closing_arr, first_sorted=self._groups_merged
        )
        counts = [{"count": c} for c in self._counts]
        cells, cells_from = _take_slots(
            self._cells,
            counts,
            KEY_BITS + BUCKET_BITS,
            closing_arr,
            first_sorted=self._cells_merged,
        )
        self._counts = [c["count"] for c in counts]
        if taken is None:
            self._release(closing)
            return ClosedWindows(self.empty_result())
        if prepared is not None and np.array_equal(prepared.slots, closing_arr):
            self._release(closing)
            return ClosedWindows(prepared.frame)
        # Rows taken from the merged base alone (the usual case: the window was merged when
        # the watermark passed its end) are merged already. Either way sorted by group.
        merged = groups_from == {0} and self._groups_merged
        done_groups, done = taken if merged else merge_state(*taken, self.plan.fields)
        done_cells, done_counts = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if cells is not None:
            if cells_from == {0} and self._cells_merged:
                done_cells, done_counts = cells[0], cells[1]["count"]
            else:
                done_cells, done_counts = merge_cells(cells[0], cells[1]["count"])
        result = self._finish(done_groups, done, done_cells, done_counts)
        self._release(closing)
        return ClosedWindows(result)

    def _close_with_panes(self, through_ms: int) -> ClosedWindows:
        """``close`` with panes: finalise every window ending by then, then forget them."""
        prepared, self._prepared = self._prepared, None
        windows = self._held_windows(None, through_ms)
        frame: pl.DataFrame | None
        if prepared is not None and prepared.windows == tuple(windows):
            frame = prepared.frame
            self._prepare_skips = 0
        else:
            frame = self._finish_windows(windows)
            if self._prepared_lost:
                # Rows keep reaching windows after the watermark passed them (gateways that
                # send large batches, each spanning several steps): preparing ahead only
                # assembles every window twice. Try again after a few closes.
                self._prepare_skips = PREPARE_BACKOFF
        self._prepared_lost = False
        self._drop_with_panes(through_ms)
        return ClosedWindows(self.empty_result() if frame is None else frame)

    def _finish(
        self,
        groups: npt.NDArray[np.int64],
        state: dict[str, npt.NDArray[Any]],
        cells: npt.NDArray[np.int64],
        counts: npt.NDArray[np.int64],
    ) -> pl.DataFrame:
        """Results of merged groups (sorted) and their merged sketch cells.

        Only the (window, key) states their window kind emits (a sliding window's trigger).
        """
        keep = self._emitted(groups, state)
        if keep is not None and not keep.all():
            groups, state = groups[keep], {f: c[keep] for f, c in state.items()}
            if len(cells):
                kept_cells = np.isin(cell_groups(cells), groups)
                cells, counts = cells[kept_cells], counts[kept_cells]
        quantiles: list[npt.NDArray[np.float64]] = []
        if self.plan.needs_sketch:
            wanted = list(self.plan.quantiles.values())
            quantiles = QUANTILES.finalize(self.buckets, cells, counts, groups, wanted)
        return self._finalise(groups, state, quantiles)

    def _emitted(
        self, groups: npt.NDArray[np.int64], state: dict[str, npt.NDArray[Any]]
    ) -> npt.NDArray[np.bool_] | None:
        """Which merged groups their window kind emits (None: all; ``WindowKind.emitted``)."""
        if not self._triggered or len(groups) == 0:
            return None
        window, start, _ = self._slot_info_for(groups >> KEY_BITS)
        keep = np.ones(len(groups), dtype=bool)
        for index, spec in enumerate(self.spec.windows):
            rows = window == index
            if rows.any() and spec.kind in WINDOW_KINDS:
                emitted = kind_of(spec).emitted(start[rows], state[LAST_TS.name][rows], spec)
                if emitted is not None:
                    keep[rows] = emitted
        return keep

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            window, start, _ = self._slot_info.pop(slot)
            del self._slots[(window, start)]
            self._free_slots.append(slot)

    def _finalise(
        self,
        groups: npt.NDArray[np.int64],
        state: dict[str, npt.NDArray[Any]],
        quantiles: list[npt.NDArray[np.float64]],
    ) -> pl.DataFrame:
        slots = groups >> KEY_BITS
        info = self._slot_info_for(slots)
        head = {
            "window": pl.Series(self._names, dtype=pl.String).gather(info[0]),
            "start": info[1],
            "end": info[2],
            "key": self.keys.keys_of(groups & ((1 << KEY_BITS) - 1)),
        }
        # in (slot, key id) order: grouped by window, keys in no particular order
        return results_frame(self.spec, self.plan, head, state, quantiles)

    def _slot_info_for(
        self, slots: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        table = np.array(
            [(s, *self._slot_info[s]) for s in np.unique(slots).tolist()], dtype=np.int64
        ).reshape(-1, 4)
        index = np.searchsorted(table[:, 0], slots)
        return table[index, 1], table[index, 2], table[index, 3]

    def empty_result(self) -> pl.DataFrame:
        """A results frame with no rows (the schema of every ``ClosedWindows.frame``)."""
        if self._empty is None:
            self._empty = self._empty_result()
        return self._empty

    def _empty_result(self) -> pl.DataFrame:
        return pl.DataFrame(schema=result_schema(self.spec))

    # -- checkpoints -------------------------------------------------------------------------

    def snapshot_rows(self) -> PartialRows | None:
        """The merged state in the partials' layout, for a checkpoint."""
        self.compact()
        if not self._groups or len(self._groups[0]) == 0:
            return None
        groups, columns = self._groups[0], self._columns[0]
        window, start, _ = self._slot_info_for(groups >> KEY_BITS)
        keys = groups & ((1 << KEY_BITS) - 1)
        rows = PartialRows(
            window=window.astype(np.uint8),
            start=start,
            keys=self.keys.keys_of(keys).to_list(),
            fields=dict(columns),
        )
        if self._cells and len(self._cells[0]):
            cells, counts = self._cells[0], self._counts[0]
            rows = PartialRows(
                window=rows.window,
                start=rows.start,
                keys=rows.keys,
                fields=rows.fields,
                sketch_row=np.searchsorted(groups, cell_groups(cells)),
                sketch_bucket=cell_buckets(cells),
                sketch_count=counts,
            )
        return rows

    def restore(self, rows: PartialRows | None) -> None:
        """Replace the state with a snapshot's rows (panes: ``restore_panes`` next)."""
        self._reset()
        if rows is not None and len(rows):
            self.add(rows)
            self.compact()

    def snapshot_panes(self) -> tuple[dict[str, Any] | None, int | None]:
        """The pane state, pane by pane, and ``pane_forgotten``.

        ``{"keys": packed key names (``KeyIds.packed_names``), "panes": [[window index, pane
        start, packed state], ...]}``, each pane's state packed with key ids
        (``pack_with_key_ids``). A pane is packed again only if it took rows since the last
        snapshot: a sliding window's step adds rows to its newest panes only, and packing
        every pane of every key each checkpoint was a quarter of a combiner's main thread.
        """
        panes = self.panes
        if panes is None:
            return None, None
        panes.compact()
        touched, panes.touched = panes.touched, set()
        held = set(panes.held())
        blobs = self._pane_blobs
        for pane in [p for p in blobs if p not in held]:
            del blobs[pane]
        for pane in held:
            if pane in touched or pane not in blobs:
                blob = panes.pack(pane)
                if blob is None:
                    blobs.pop(pane, None)
                else:
                    blobs[pane] = blob
        if not blobs:
            return None, self.pane_forgotten
        chunks = [[w, s, blobs[(w, s)]] for w, s in sorted(blobs)]
        return {"keys": self.keys.packed_names(), "panes": chunks}, self.pane_forgotten

    def restore_panes(
        self, rows: dict[str, Any] | PartialRows | None, forgotten: int | None
    ) -> None:
        """Replace the pane state with a snapshot's (``snapshot_panes``; after ``restore``).

        ``rows`` may also be the pane state as one ``PartialRows`` (a checkpoint written before
        panes were packed one by one).

        Raises:
            SchemaError: an unreadable pane.
        """
        if self.panes is None:
            return
        restored = rows if isinstance(rows, PartialRows) else None
        if isinstance(rows, dict):
            names = unpack_names(rows["keys"])
            parts = [
                unpack_with_key_names(msgpack.unpackb(blob, raw=False), names)
                for _, _, blob in rows["panes"]
            ]
            restored = concat_rows(parts) if parts else None
        self.panes.restore(restored)
        self.pane_forgotten = forgotten


@dataclass(slots=True)
class _Pane:
    """One pane's state: merged arrays (``Keyed``'s layout) and rows not merged yet."""

    end: int
    """The end of the pane's newest window: it is dropped with it."""
    merged: Keyed
    pending: list[Keyed] = field(default_factory=list)
    pending_rows: int = 0


class PaneState:
    """State per (pane, key) of a partition's pane windows (``WindowState.panes``).

    Each pane keeps its own merged arrays (key ids ascending, the plan's fields, sketch cells
    ``key << BUCKET_BITS | bucket``) and the rows appended since the last ``compact``. A
    sliding window's step adds rows to its newest panes and drops its oldest: with one
    sorted set of arrays for all panes, both copied every pane's state each step.
    """

    def __init__(self, spec: PipelineSpec, plan: AggregatePlan, keys: KeyIds) -> None:
        self.plan = plan
        self.keys = keys
        self._sizes = [w.size_ms for w in spec.windows]
        self._version = 0
        self._panes: dict[tuple[int, int], _Pane] = {}
        self._pending_rows = 0
        self.touched: set[tuple[int, int]] = set()
        """(window, start) that took rows since the last ``WindowState.snapshot_panes``."""
        self.versions: dict[tuple[int, int], int] = {}
        """Per held pane, a number that changes whenever it takes rows (the stacks' validity)."""

    def clear(self) -> None:
        """Forget every pane."""
        self._panes.clear()
        self._pending_rows = 0
        self.touched.clear()
        self.versions.clear()

    @property
    def rows(self) -> int:
        """State rows held, merged and pending, sketch cells included."""
        merged = sum(len(p.merged.keys) + len(p.merged.cells) for p in self._panes.values())
        return merged + self._pending_rows

    @property
    def pending_rows(self) -> int:
        """Rows appended since the last merge."""
        return self._pending_rows

    def held(self) -> list[tuple[int, int]]:
        """(window index, pane start) of every pane held."""
        return list(self._panes)

    def merged(self, pane: tuple[int, int]) -> Keyed | None:
        """A pane's merged state (as of the last ``compact``); None: not held."""
        held = self._panes.get(pane)
        return None if held is None else held.merged

    def add(self, rows: PartialRows, key_ids: npt.NDArray[np.int64] | None = None) -> None:
        """Append pane rows (``start``: the pane's start; the plan's fields).

        ``key_ids``: the rows' key ids when the caller has them (``WindowState.take_panes``
        does: looking a partial's 10,000 keys up again cost as much as the first time).
        """
        if len(rows) == 0:
            return
        if key_ids is None:
            key_ids = self.keys.key_ids(rows.keys)
        pairs = (rows.window.astype(np.int64) << 55) | (rows.start + 2**54)
        unique, inverse = np.unique(pairs, return_inverse=True)
        inverse = inverse.reshape(-1)
        cell_pane = None
        if rows.sketch_row is not None and self.plan.needs_sketch:
            cell_pane = inverse[rows.sketch_row]
        for i, packed in enumerate(unique.tolist()):
            w, s = packed >> 55, (packed & (2**55 - 1)) - 2**54
            take = np.flatnonzero(inverse == i) if len(unique) > 1 else np.arange(len(rows))
            cells, counts = _NO_CELLS, _NO_CELLS
            if cell_pane is not None:
                assert rows.sketch_row is not None
                assert rows.sketch_bucket is not None
                assert rows.sketch_count is not None
                mine = cell_pane == i
                cells = cell_ids(key_ids[rows.sketch_row[mine]], rows.sketch_bucket[mine])
                counts = rows.sketch_count[mine]
            columns = {f: rows.fields[f][take] for f in self.plan.field_names}
            pane = self._panes.get((w, s))
            if pane is None:
                pane = self._panes[(w, s)] = _Pane(s + self._sizes[w], _empty_keyed(self.plan))
            pane.pending.append(Keyed(key_ids[take], columns, cells, counts))
            added = len(take) + len(cells)
            pane.pending_rows += added
            self._pending_rows += added
            self.touched.add((w, s))
            self._version += 1
            self.versions[(w, s)] = self._version
        if self._pending_rows >= COMPACT_ROWS:
            self.compact()

    def compact(self) -> None:
        """Merge each pane's pending rows into its merged arrays.

        Inserted (``_insert_state``, ``add_cells``) while they are few next to what the pane
        holds; either way the merged rows first, then the pending ones.
        """
        for pane in self._panes.values():
            if pane.pending:
                pane.merged = self._merged(pane.merged, pane.pending)
                pane.pending, pane.pending_rows = [], 0
        self._pending_rows = 0

    def _merged(self, base: Keyed, parts: list[Keyed]) -> Keyed:
        fields = self.plan.fields
        keys = np.concatenate([p.keys for p in parts])
        columns = {f.name: np.concatenate([p.columns[f.name] for p in parts]) for f in fields}
        if len(base.keys) and len(keys) * INSERT_SHARE < len(base.keys):
            keys, columns = _insert_state(base.keys, base.columns, keys, columns, fields)
        elif len(base.keys):
            keys, columns = _merged_into(base, keys, columns, fields)
        else:
            keys, columns = merge_state(keys, columns, fields)
        cells, counts = base.cells, base.counts
        new_cells = np.concatenate([p.cells for p in parts])
        if len(new_cells):
            new_counts = np.concatenate([p.counts for p in parts])
            cells, counts = add_cells(cells, counts, new_cells, new_counts)
        return Keyed(keys, columns, cells, counts)

    def drop(self, through_ms: int) -> int:
        """Forget the panes whose newest window ends at or before ``through_ms``; how many."""
        gone = [p for p, pane in self._panes.items() if pane.end <= through_ms]
        for pane in gone:
            self._pending_rows -= self._panes.pop(pane).pending_rows
            self.versions.pop(pane, None)
        return len(gone)

    def restore(self, rows: PartialRows | None) -> None:
        """Replace the state with a snapshot's rows."""
        self.clear()
        if rows is not None and len(rows):
            self.add(rows)
            self.compact()

    def pack(self, pane: tuple[int, int]) -> bytes | None:
        """One pane's merged state, packed with key ids (``snapshot_panes``); None: no rows."""
        self.compact()
        held = self.merged(pane)
        if held is None or len(held.keys) == 0:
            return None
        return pack(pack_with_key_ids(_pane_rows(pane, held), held.keys))

    def snapshot_rows(self) -> PartialRows | None:
        """Every pane's merged state as one ``PartialRows`` (a checkpoint's older layout)."""
        self.compact()
        parts = [
            replace(_pane_rows(p, held.merged), keys=self.keys.keys_of(held.merged.keys).to_list())
            for p, held in sorted(self._panes.items())
            if len(held.merged.keys)
        ]
        return concat_rows(parts) if parts else None


_NO_CELLS: Final = np.zeros(0, dtype=np.int64)


def _empty_keyed(plan: AggregatePlan) -> Keyed:
    columns = {f.name: np.zeros(0, dtype=f.np_dtype) for f in plan.fields}
    return Keyed(_NO_CELLS, columns, _NO_CELLS, _NO_CELLS)


def _merged_into(
    base: Keyed,
    keys: npt.NDArray[np.int64],
    columns: dict[str, npt.NDArray[Any]],
    fields: Sequence[FieldKernels],
) -> tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]:
    """``merge_state`` of a pane's merged rows, then the rows appended since (``keys``).

    The appended rows usually hold a key once (each gateway's partial its own sensors):
    then, sorted, they are a second state with unique keys, merged with the pane's as two
    runs (``merge_pair``: interleaved when both hold the same keys), which gives the same
    groups, rows in the same order, as sorting everything. Otherwise everything is sorted.
    """
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    if len(ordered) > 1 and not (ordered[1:] != ordered[:-1]).all():
        both = np.concatenate((base.keys, keys))
        stacked = {f: np.concatenate((base.columns[f], c)) for f, c in columns.items()}
        return merge_state(both, stacked, fields)
    ordered_columns = {f: c[order] for f, c in columns.items()}
    return merge_pair(base.keys, base.columns, ordered, ordered_columns, fields)


def _pane_rows(pane: tuple[int, int], state: Keyed) -> PartialRows:
    """A pane's merged state in the partials' layout, without key names."""
    n = len(state.keys)
    rows = PartialRows(
        window=np.full(n, pane[0], dtype=np.uint8),
        start=np.full(n, pane[1], dtype=np.int64),
        keys=[],
        fields=dict(state.columns),
    )
    if len(state.cells) == 0:
        return rows
    return replace(
        rows,
        sketch_row=np.searchsorted(state.keys, cell_groups(state.cells)),
        sketch_bucket=cell_buckets(state.cells),
        sketch_count=state.counts,
    )


def unpack_names(chunks: list[bytes]) -> list[str | None]:
    """Key names from ``KeyIds.packed_names``.

    Raises:
        SchemaError: a chunk is not an array of names.
    """
    names: list[str | None] = []
    for chunk in chunks:
        part = msgpack.unpackb(chunk, raw=False)
        if not isinstance(part, list):
            raise SchemaError("key names are not a list", reason="bad_checkpoint")
        names.extend(part)
    return names


def result_columns(spec: PipelineSpec, plan: AggregatePlan) -> list[pl.Expr | str]:
    """The layout of ``ClosedWindows.frame``, from merged state columns.

    The frame selected from has ``window``, ``start``, ``end``, ``key``, the state fields,
    one column per quantile and one per eager aggregate (``AggregatePlan.with_eager_outputs``).
    """
    return [
        "window",
        "start",
        "end",
        "key",
        pl.col("n").alias("rows"),
        "batches",
        *(
            pl.col(name) if name in plan.quantiles or name in plan.eager else plan.outputs[name]
            for name in spec.aggregate_names
        ),
    ]


def results_frame(
    spec: PipelineSpec,
    plan: AggregatePlan,
    head: dict[str, Any],
    state: Mapping[str, npt.NDArray[Any]],
    quantiles: list[npt.NDArray[np.float64]],
) -> pl.DataFrame:
    """A results frame (``ClosedWindows.frame``) from merged state.

    ``head``: the ``window``, ``start``, ``end`` and ``key`` columns; ``state``: the plan's
    merged fields; ``quantiles``: the finalised sketch estimates, in the plan's order.
    """
    frame = pl.DataFrame(
        {
            **head,
            **{f: state[f] for f in plan.field_names},
            **dict(zip(plan.quantiles, quantiles, strict=True)),
        },
        schema_overrides={f.name: f.dtype for f in plan.fields},
    )
    return plan.with_eager_outputs(frame).select(result_columns(spec, plan))


def result_schema(spec: PipelineSpec) -> dict[str, pl.DataType]:
    """The schema of ``result_columns``."""
    schema: dict[str, pl.DataType] = dict(RESULT_BASE_SCHEMA)
    for aggregate in spec.aggregates:
        known = aggregate.entry
        schema[aggregate.name] = pl.Float64() if known is None else known.dtype
    return schema


@dataclass(frozen=True, slots=True)
class _Prepared:
    """Results finalised ahead of a close (``WindowState.prepare``), and their slots."""

    slots: npt.NDArray[np.int64]
    frame: pl.DataFrame
    windows: tuple[tuple[int, int], ...] = ()
    """With panes: the (window index, start) pairs finalised."""


def _continued(
    start: npt.NDArray[np.int64],
    window: npt.NDArray[np.int64],
    key_ids: npt.NDArray[np.int64],
    slide: npt.NDArray[np.int64],
    fan: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_] | None:
    """Per pane row of one batch, whether its key's run of consecutive panes began earlier.

    That is, whether the key's previous pane with a row in the batch is the one just before.
    None when a key has two panes 2 to ``fan - 1`` apart.
    """
    order = np.lexsort((start, key_ids, window))
    w, k, s = window[order], key_ids[order], start[order]
    same = (w[1:] == w[:-1]) & (k[1:] == k[:-1])
    apart = (s[1:] - s[:-1]) // slide[order][1:]
    if (same & (apart >= 2) & (apart < fan[order][1:])).any():
        return None
    continued = np.zeros(len(order), dtype=np.bool_)
    continued[order[1:]] = same & (apart == 1)
    return continued


def _insert_state(
    base: npt.NDArray[np.int64],
    base_columns: dict[str, npt.NDArray[Any]],
    groups: npt.NDArray[np.int64],
    columns: dict[str, npt.NDArray[Any]],
    fields: Sequence[FieldKernels],
) -> tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]]:
    """Merge a few pending state rows into a large merged base: sorted inserts, no re-sort.

    Only the base rows of the groups that have pending rows are merged with them, the base's
    row first, then the pending rows in their order: exactly the rows, in the order, that a
    merge of the whole (base, then pending) gives each group, so the result is the same to
    the last bit of every float field. A pane kind's state takes rows for its newest panes
    only, and re-sorting every pane of every key at each step was most of a combiner's
    merging (``compact``).
    """
    at = np.searchsorted(base, groups)
    known = at < len(base)
    known[known] = base[at[known]] == groups[known]
    touched = np.unique(at[known])
    merged_groups, merged = merge_state(
        np.concatenate((base[touched], groups)),
        {f: np.concatenate((base_columns[f][touched], c)) for f, c in columns.items()},
        fields,
    )
    where = np.searchsorted(base, merged_groups)
    found = where < len(base)
    found[found] = base[where[found]] == merged_groups[found]
    new = where[~found]
    # a found row's index once the new rows are inserted before it
    moved = where[found] + np.searchsorted(new, where[found], side="right")
    out_columns = {}
    for name, column in base_columns.items():
        out = np.insert(column, new, merged[name][~found])
        out[moved] = merged[name][found]
        out_columns[name] = out
    return np.insert(base, new, merged_groups[~found]), out_columns


def _take_slots(
    ids: list[npt.NDArray[np.int64]],
    columns: list[dict[str, npt.NDArray[Any]]],
    shift: int,
    slots: npt.NDArray[np.int64],
    *,
    first_sorted: bool,
) -> tuple[tuple[npt.NDArray[np.int64], dict[str, npt.NDArray[Any]]] | None, set[int]]:
    """Remove the rows of ``slots`` (sorted) from every chunk (in place); return them unmerged.

    Chunk ``i`` is ``ids[i]`` (state groups or sketch cells, whose slot is ``id >> shift``)
    with its parallel ``columns[i]``. Also returns the indices of the chunks the rows came
    from. Chunks keep their places, even when emptied: the first one may be the merged base.
    When it is (``first_sorted``), each slot's rows are one run of it, found by binary search
    instead of a pass over every row; taken in slot order, they stay sorted.
    """
    taken_ids: list[npt.NDArray[np.int64]] = []
    taken_columns: list[dict[str, npt.NDArray[Any]]] = []
    chunks: set[int] = set()
    for i, chunk in enumerate(ids):
        if i == 0 and first_sorted:
            lo, hi = _slot_bounds(chunk, slots, shift)
            if not (hi > lo).any():
                continue
            take = _runs(lo, hi)
            keep = _runs(np.concatenate(([0], hi)), np.concatenate((lo, [len(chunk)])))
        else:
            mask = np.isin(chunk >> shift, slots)
            if not mask.any():
                continue
            take, keep = np.flatnonzero(mask), np.flatnonzero(~mask)
        chunks.add(i)
        taken_ids.append(chunk[take])
        taken_columns.append({f: c[take] for f, c in columns[i].items()})
        ids[i] = chunk[keep]
        columns[i] = {f: c[keep] for f, c in columns[i].items()}
    if not taken_ids:
        return None, chunks
    names = taken_columns[0].keys()
    return (
        np.concatenate(taken_ids),
        {f: np.concatenate([c[f] for c in taken_columns]) for f in names},
    ), chunks


def _slot_bounds(
    chunk: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], shift: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Where each of ``slots`` (sorted) starts and ends in a sorted chunk (slot: id >> shift)."""
    return np.searchsorted(chunk, slots << shift), np.searchsorted(chunk, (slots + 1) << shift)


def _slot_runs(
    chunk: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], shift: int
) -> slice | npt.NDArray[np.int64]:
    """The indices of the rows of ``slots`` (sorted) in a sorted chunk of ids."""
    return _runs(*_slot_bounds(chunk, slots, shift))


def _runs(lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64]) -> slice | npt.NDArray[np.int64]:
    """The indices of the runs ``[lo[i], hi[i])`` (in order), as a slice when there is one."""
    nonempty = hi > lo
    lo, hi = lo[nonempty], hi[nonempty]
    if len(lo) == 1:
        return slice(int(lo[0]), int(hi[0]))
    if len(lo) == 0:
        return slice(0, 0)
    return gather_runs(lo, hi - lo)
