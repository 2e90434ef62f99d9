"""Count windows at the combiner: rows wait until their order is final, then fill windows of n.

A count window is every ``n`` rows of a key in event order ``(ts, gateway, seq, row)``
(``windows.COUNT_ORDER``). Workers ship rows (``partials.EventRows``), not state. A row's
rank within its key is final once every row that could come before it has been applied: once
the close threshold (pipeline watermark minus ``lateness_ms``) has passed its timestamp,
because a row applied later with a smaller timestamp is late (``combine``). So:

1. ``add`` buffers a batch's on-time rows (with its gateway and seq).
2. ``finalise(threshold)`` takes the buffered rows with ``ts < threshold``, sorts them in
   event order per key and numbers them on, per count window, from the key's *unfinished
   window* (the final rows not yet in a full window, all of which come before them). Every
   run of ``n`` rows is a window: its aggregates come from the registry's kernels
   (``_kernels.partial_state`` over the window's new rows, ``merge_state`` with the
   unfinished window it completes: the same code that computes and merges partials; then
   the aggregates' finalisers and the sketch's quantiles), its ordinal within the key from
   the key's count of finished windows. The rest becomes the key's new unfinished window.
3. ``finalise(..., flush=True)`` (end of stream) also emits every unfinished window, with
   fewer than ``n`` rows.

Memory: the buffer holds the rows not yet final (about ``lateness_ms`` plus the watermark's
lag worth of input), 24 bytes a row (``ROW_DTYPES``; a chunk's gateway and seq are
``_constant``). An unfinished window is *folded*
(``_Unfinished``): its rows are ranked, so only their count, first and last event time,
merged state fields, sketch cells (one per bucket it holds; quantiles only) and the set of
batches it drew from (``batches`` counts distinct batches, which does not add up) are kept,
not the rows; of that set only the batches that still have rows buffered, the others are a
count per key (``_Unfinished._settle``). A checkpoint packs buffered rows at 12 bytes a row,
each chunk once while it stays buffered (``CountState._packed_pending``), and writes them by
reference (``_packing.Packed``): its values are the chunk's own column. Everything is in
numpy arrays; nothing loops over rows in Python (keys only when a key list is first seen).

Imports ``partials`` (rows), ``state`` (the results layout), ``aggregates``/``_kernels``/
``sketch`` (the registry); never I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import SchemaError
from shoal.processors._kernels import (
    FieldKernels,
    GroupSort,
    cell_buckets,
    cell_groups,
    cell_ids,
    gather_runs,
    merge_cells,
    merge_state,
    partial_state,
    run_bounds,
)
from shoal.processors._packing import Packed
from shoal.processors.aggregates import BATCHES, QUANTILES, AggregatePlan
from shoal.processors.partials import EventRows
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import KeyIds, result_columns, result_schema

Int64Array = npt.NDArray[np.int64]

COUNT_SNAPSHOT_VERSION: Final = 2
"""Unfinished windows as folded state (1, unmarked: as rows)."""
RESULT_EXTRAS: Final = ("index", "first_ts", "last_ts")
"""Per-key columns count-window results carry besides the usual ones (all Int64)."""

ROWS_PER_CELL: Final = 8
"""Buffered rows that count as one state cell (``max_state_cells``): a cell of merged state
costs ~200-300 bytes (docs/benchmarks.md), a buffered row 24 (``ROW_DTYPES``) plus 4 for
its packed key id and time (``CountState._packed_pending``; its value is packed as it is)."""

ROW_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "key": np.dtype("<i4"),
    "ts": np.dtype("<i8"),
    "gateway": np.dtype("<i4"),
    "seq": np.dtype("<i8"),
    "row": np.dtype("<i4"),
    "value": np.dtype("<f8"),
}
"""Column types of held rows: 24 bytes a buffered row (its chunk's gateway and seq are
``_constant``), 32 in the final rows a close step sorts (its row numbers ``_constant``;
key ids < 2**24, rows in a batch < 2**31)."""


_Columns = TypeVar("_Columns", "_Rows", "_Entries")
"""A dataclass of equally long numpy columns."""


def _concat_columns(cls: type[_Columns], parts: list[_Columns]) -> _Columns:
    """Column by column, every row of ``parts`` in order (none: ``cls.empty()``)."""
    if not parts:
        return cls.empty()
    if len(parts) == 1:
        return parts[0]
    return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass(frozen=True, slots=True)
class _Rows:
    """Rows as parallel columns: key id, event time, gateway id, seq, row in batch, value."""

    key: npt.NDArray[np.int32]
    ts: Int64Array
    gateway: npt.NDArray[np.int32]
    seq: Int64Array
    row: npt.NDArray[np.int32]
    value: npt.NDArray[np.float64]

    def __len__(self) -> int:
        return len(self.ts)

    def take(self, index: Int64Array | npt.NDArray[np.bool_]) -> _Rows:
        """The rows at ``index`` (positions or a mask); constant columns stay ``_constant``."""
        ts = self.ts[index]
        columns: list[npt.NDArray[Any]] = []
        for f in fields(self):
            column = getattr(self, f.name)
            if f.name == "ts":
                columns.append(ts)
            elif column.strides == (0,) and len(column):
                columns.append(_constant(int(column[0]), len(ts), column.dtype))
            else:
                columns.append(column[index])
        return _Rows(*columns)

    @classmethod
    def empty(cls) -> _Rows:
        """No rows."""
        return cls(**{name: np.zeros(0, dtype=dtype) for name, dtype in ROW_DTYPES.items()})

    @classmethod
    def concat(cls, parts: list[_Rows]) -> _Rows:
        """All rows of ``parts``, in order."""
        return _concat_columns(cls, parts)

    def pack(self, span: tuple[int, int] | None = None) -> dict[str, Any]:
        """Little-endian buffers (checkpoints), as views of arrays that do not change.

        A chunk of one batch (one gateway and seq, as ``CountState.add`` buffers them) keeps
        those two as numbers, its key ids and event times (as offsets) in the narrowest of
        uint16 and int32 that holds them, and no row numbers while they increase (only
        their order within the batch counts, ``COUNT_ORDER``: a restore numbers them 0, 1,
        ...): 12 bytes a row at scenario B instead of 36 (the buffered rows are most of a
        count window's checkpoint). Other chunks pack every column. ``span``: the smallest
        and largest ts, if known. The values are the column itself, not a copy (a chunk's
        columns are never written to).
        """
        n = len(self)
        if n and _constant_column(self.gateway) and _constant_column(self.seq):
            low, high = (int(self.ts.min()), int(self.ts.max())) if span is None else span
            packed: dict[str, Any] = {
                "gateway": int(self.gateway[0]),
                "seq": int(self.seq[0]),
                "value": _little_endian(self.value, ROW_DTYPES["value"]),
                **_narrow("key", self.key, 0, int(self.key.max())),
            }
            if n > 1 and not (self.row[1:] > self.row[:-1]).all():
                packed["row"] = _little_endian(self.row, ROW_DTYPES["row"])
            if high - low < 2**31:
                packed.update(ts_base=low, **_narrow("ts", self.ts, low, high - low))
            else:
                packed["ts"] = _little_endian(self.ts, ROW_DTYPES["ts"])
            return packed
        return {
            f.name: _little_endian(getattr(self, f.name), ROW_DTYPES[f.name]) for f in fields(self)
        }

    @classmethod
    def unpack(cls, obj: dict[str, Any]) -> _Rows:
        """Inverse of ``pack`` (row numbers left out come back as 0, 1, ...)."""
        try:
            n = len(obj["value"]) // ROW_DTYPES["value"].itemsize
            cols: dict[str, npt.NDArray[Any]] = {}
            for name, dtype in ROW_DTYPES.items():
                if name == "row" and name not in obj:
                    cols[name] = np.arange(n, dtype=dtype)
                    continue
                raw = obj[name]
                narrow = np.dtype(obj.get(f"{name}_dtype", dtype))
                if name == "ts" and "ts_base" in obj:
                    narrow = np.dtype(obj.get("ts_dtype", "<i4"))
                    cols[name] = np.frombuffer(raw, narrow).astype(dtype) + int(obj["ts_base"])
                elif isinstance(raw, int) and name in {"gateway", "seq"}:
                    cols[name] = _constant(raw, n, dtype)
                elif narrow.kind not in "iuf" or narrow.itemsize > dtype.itemsize:
                    raise SchemaError(f"count-window rows as {narrow}", reason="bad_checkpoint")
                else:
                    cols[name] = np.frombuffer(raw, dtype=narrow).astype(dtype)
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(
                f"unreadable count-window rows: {exc}", reason="bad_checkpoint"
            ) from exc
        if len({len(c) for c in cols.values()}) != 1:
            raise SchemaError("inconsistent count-window rows", reason="bad_checkpoint")
        return cls(**cols)


@dataclass(frozen=True, slots=True)
class _Final:
    """A close step's final rows in event order (by key, then ``COUNT_ORDER``) and their batches.

    ``batch`` numbers each row's batch, an index into ``gateways`` and ``seqs``; the batches
    are numbered in (gateway id, seq) order, so that ordering by number orders by batch
    (``_row_batches``). Row numbers are not carried: once the rows are in event order,
    nothing reads them.
    """

    key: npt.NDArray[np.int32]
    ts: Int64Array
    value: npt.NDArray[np.float64]
    batch: npt.NDArray[np.int32]
    gateways: Int64Array
    seqs: Int64Array

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def gateway(self) -> Int64Array:
        """Each row's gateway id."""
        gateway: Int64Array = self.gateways[self.batch]
        return gateway

    @property
    def seq(self) -> Int64Array:
        """Each row's batch seq."""
        seq: Int64Array = self.seqs[self.batch]
        return seq

    @classmethod
    def of(cls, rows: _Rows) -> _Final:
        """``rows``, in event order already, with their batches numbered."""
        if len(rows) == 0:
            nothing = np.zeros(0, dtype=np.int64)
            return cls(rows.key, rows.ts, rows.value, np.zeros(0, np.int32), nothing, nothing)
        pairs = np.stack((rows.gateway.astype(np.int64), rows.seq.astype(np.int64)), axis=1)
        batches, number = np.unique(pairs, axis=0, return_inverse=True)  # (gateway, seq) order
        return cls(
            rows.key,
            rows.ts,
            rows.value,
            number.reshape(-1).astype(np.int32),
            batches[:, 0].copy(),
            batches[:, 1].copy(),
        )


def _constant(value: int, n: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``n`` times ``value``, read-only, in no memory.

    A buffered chunk's gateway and seq: 12 of a row's 36 bytes otherwise.
    """
    return np.broadcast_to(np.asarray(value, dtype=dtype), (n,))


def _narrow(name: str, values: npt.NDArray[Any], base: int, top: int) -> dict[str, Any]:
    """``values - base`` as uint16 if they fit, else int32 (its buffer: a view, no copy).

    None of them is negative, none above ``top``.
    """
    dtype = np.dtype("<u2" if top < 2**16 else "<i4")
    narrow = (values - base if base else values).astype(dtype)
    return {name: narrow.data.cast("B"), f"{name}_dtype": dtype.str}


def _little_endian(column: npt.NDArray[Any], dtype: np.dtype[Any]) -> memoryview:
    """``column``'s buffer as ``dtype`` (little-endian), the column itself when it is so."""
    if column.dtype != dtype or not column.flags.c_contiguous:
        column = np.ascontiguousarray(column, dtype=dtype)
    return column.data.cast("B")


@dataclass(slots=True)
class _Entries:
    """Sparse per-key entries of unfinished windows, in no particular order.

    A key id and two int64 columns: batch sets (gateway id, seq) or sketch cells (bucket,
    count).
    """

    key: npt.NDArray[np.int32]
    a: Int64Array
    b: Int64Array

    @classmethod
    def empty(cls) -> _Entries:
        """No entries."""
        return cls(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.key)

    def where(self, keep: npt.NDArray[np.bool_] | Int64Array) -> _Entries:
        """The entries ``keep`` (a mask or positions) picks."""
        return _Entries(self.key[keep], self.a[keep], self.b[keep])

    @classmethod
    def concat(cls, parts: list[_Entries]) -> _Entries:
        """All entries of ``parts``."""
        return _concat_columns(cls, parts)

    def pack(self) -> list[bytes]:
        """Raw little-endian buffers (checkpoints)."""
        return [
            self.key.astype("<i4").tobytes(),
            self.a.astype("<i8").tobytes(),
            self.b.astype("<i8").tobytes(),
        ]

    @classmethod
    def unpack(cls, obj: list[bytes]) -> _Entries:
        """Inverse of ``pack``."""
        key, a, b = (
            np.frombuffer(x, dtype=t).copy()
            for x, t in zip(obj, ("<i4", "<i8", "<i8"), strict=True)
        )
        if not len(key) == len(a) == len(b):
            raise SchemaError("inconsistent count-window entries", reason="bad_checkpoint")
        return cls(key, a, b)


MAX_ENTRY_CHUNKS: Final = 1024
ENTRY_SLACK: Final = 65_536
"""Entries an ``_EntryStore`` adds beyond twice its last consolidation before it consolidates."""
"""Chunks of unfinished windows' entries kept at most (each ``take`` looks into every one)."""


@dataclass(slots=True)
class _Chunk:
    """Entries added in one step, sorted by key: one run ``lo[i]:hi[i]`` per key ``keys[i]``.

    A key's run dies (``alive``) when its window finishes and its entries are taken out.
    """

    entries: _Entries
    keys: npt.NDArray[np.int32]
    lo: Int64Array
    hi: Int64Array
    alive: npt.NDArray[np.bool_]

    @classmethod
    def of(cls, entries: _Entries) -> _Chunk:
        """A chunk of ``entries`` (sorted here by key, unless they already are)."""
        if len(entries) > 1 and (entries.key[1:] < entries.key[:-1]).any():
            entries = entries.where(np.argsort(entries.key, kind="stable"))
        lo, lengths = run_bounds(entries.key)
        return cls(entries, entries.key[lo], lo, lo + lengths, np.ones(len(lo), dtype=bool))

    def take(self, keys: Int64Array) -> _Entries | None:
        """The entries of those of ``keys`` (sorted) whose runs are alive here; kills them."""
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = (self.keys[pos] == keys) & self.alive[pos]
        runs = pos[hit]
        if len(runs) == 0:
            return None
        self.alive[runs] = False
        return self.entries.where(gather_runs(self.lo[runs], self.hi[runs] - self.lo[runs]))

    def live(self) -> _Entries:
        """Every entry of a live run."""
        if self.alive.all():
            return self.entries
        runs = np.flatnonzero(self.alive)
        return self.entries.where(gather_runs(self.lo[runs], self.hi[runs] - self.lo[runs]))


class _EntryStore:
    """Entries of unfinished windows (batch sets or sketch cells), added and taken by key.

    Kept in chunks, one a step, so that a step costs what it adds and what its finished
    windows take out, not everything held: a key's entries leave all at once, when its
    window finishes. Entries may repeat across steps (a batch whose rows were final in two
    steps, a bucket hit in both); ``squash`` merges repeats when the chunks are consolidated,
    which happens once they hold twice the entries of the last consolidation (dead runs and
    repeats), or too many chunks: memory stays within about twice the distinct entries.
    """

    def __init__(
        self,
        squash: Callable[[_Entries], _Entries],
        settle: Callable[[_Entries], _Entries] | None = None,
    ) -> None:
        self.chunks: list[_Chunk] = []
        self._squash = squash
        self._settle = settle
        self._floor = 0
        self._held = 0  # entries in the chunks, dead runs included

    def __len__(self) -> int:
        return self._held

    def add(self, entries: _Entries) -> None:
        """Entries of this step."""
        if len(entries):
            self.chunks.append(_Chunk.of(entries))
            self._held += len(entries)
            if self._held > 2 * self._floor + ENTRY_SLACK or len(self.chunks) > MAX_ENTRY_CHUNKS:
                entries = self.all()
                self._hold(entries if self._settle is None else self._settle(entries))

    def take(self, keys: Int64Array) -> _Entries:
        """Take out every entry of ``keys`` (sorted, unique)."""
        if len(keys) == 0:
            return _Entries.empty()
        parts = [e for e in (c.take(keys) for c in self.chunks) if e is not None]
        self.chunks = [c for c in self.chunks if c.alive.any()]
        self._held = sum(len(c.entries) for c in self.chunks)
        return _Entries.concat(parts)

    def all(self) -> _Entries:
        """Every live entry, repeats merged."""
        return self._squash(self.live())

    def live(self) -> _Entries:
        """Every live entry, repeats included.

        Cheap, for checkpoints (taken every second); a restore merges the repeats.
        """
        return _Entries.concat([c.live() for c in self.chunks])

    def replace(self, entries: _Entries) -> None:
        """Hold exactly ``entries`` (repeats merged)."""
        self._hold(self._squash(entries))

    def _hold(self, entries: _Entries) -> None:
        """Hold exactly ``entries``, whose repeats are merged already (one squash, not two)."""
        self.chunks = [_Chunk.of(entries)] if len(entries) else []
        self._floor = self._held = len(entries)


def _batch_ids(gateway: Int64Array, seq: Int64Array) -> Int64Array:
    """One int64 per batch: ``gateway << 40 | seq`` (gateway ids are dense and small)."""
    ids: Int64Array = (gateway.astype(np.int64) << 40) | seq.astype(np.int64)
    return ids


def _batch_ids_fit(gateway: Int64Array, seq: Int64Array) -> bool:
    """Whether ``_batch_ids`` are distinct for these batches."""
    return bool(
        int(gateway.min()) >= 0
        and int(gateway.max()) < 1 << 22
        and int(seq.min()) >= 0
        and int(seq.max()) < 1 << 40
    )


def _distinct(entries: _Entries) -> _Entries:
    """Batch entries: each (key, gateway, seq) once, sorted by (key, gateway, seq).

    The three columns are packed into one int64 when their spans fit (gateway ids are
    dense, seqs of one step close together: always, in practice), so one sort of one column
    does what a three-key ``lexsort`` would; repeats next to each other (a key's rows of one
    batch, in event order) are dropped first with one linear pass, so that the sort sees
    about one entry per key and batch.
    """
    packed = _pack_entries(entries)
    if packed is None:
        return _distinct_lexsort(entries)
    values, shift_a, shift_b, base_b = packed
    if len(values) > 1:
        values = values[np.concatenate(([True], values[1:] != values[:-1]))]
    values = np.sort(values)
    if len(values) > 1:
        values = values[np.concatenate(([True], values[1:] != values[:-1]))]
    mask_b = (1 << shift_b) - 1
    return _Entries(
        (values >> shift_a).astype(np.int32),
        (values >> shift_b) & ((1 << (shift_a - shift_b)) - 1),
        (values & mask_b) + base_b,
    )


def _pack_entries(entries: _Entries) -> tuple[Int64Array, int, int, int] | None:
    """Entries as one non-negative int64 ``key << shift_a | a << shift_b | (b - base_b)``.

    Ordered as (key, a, b); returns (packed, shift_a, shift_b, base_b), or None when the
    columns' spans do not fit in 63 bits (or ``key`` or ``a`` is negative).
    """
    if len(entries) == 0:
        return None
    key, a, b = entries.key, entries.a, entries.b
    if int(key.min()) < 0 or int(a.min()) < 0:
        return None
    base_b = int(b.min())
    bits_b = max(1, (int(b.max()) - base_b).bit_length())
    bits_a = max(1, int(a.max()).bit_length())
    if int(key.max()).bit_length() + bits_a + bits_b > 63:
        return None
    shift_b, shift_a = bits_b, bits_a + bits_b
    values = (key.astype(np.int64) << shift_a) | (a.astype(np.int64) << shift_b) | (b - base_b)
    return values, shift_a, shift_b, base_b


def _distinct_lexsort(entries: _Entries) -> _Entries:
    """``_distinct`` for entries whose columns do not pack into one int64."""
    key, a, b = entries.key, entries.a, entries.b
    if len(key) > 1:
        fresh = np.ones(len(key), dtype=bool)
        fresh[1:] = (key[1:] != key[:-1]) | (a[1:] != a[:-1]) | (b[1:] != b[:-1])
        entries = entries.where(fresh)
    e = entries.where(np.lexsort((entries.b, entries.a, entries.key)))
    new = np.ones(len(e), dtype=bool)
    new[1:] = (e.key[1:] != e.key[:-1]) | (e.a[1:] != e.a[:-1]) | (e.b[1:] != e.b[:-1])
    return e.where(new)


def _summed(entries: _Entries) -> _Entries:
    """Sketch cells: each (key, bucket) once, with its counts summed."""
    cells, counts = merge_cells(cell_ids(entries.key.astype(np.int64), entries.a), entries.b)
    return _Entries(cell_groups(cells).astype(np.int32), cell_buckets(cells), counts)


class _Unfinished:
    """One count window's unfinished windows, folded: per key its rows so far as state.

    A key's final rows not yet in a full window are all ranked (they precede every row still
    to come), so they need not be kept: their count, first and last event time, merged state
    fields (the registry's ``merge_np``, as for partials), sketch cells (quantiles) and the
    set of batches they came from (``batches`` counts distinct batches, which does not add
    up) are enough to finish the window when later rows fill it. Memory per key: the fields,
    plus about one entry per distinct batch and per sketch bucket (``_EntryStore``: at most
    twice that), instead of 24 bytes a row.
    """

    def __init__(self, fields: Sequence[FieldKernels]) -> None:
        self.fields = list(fields)
        self.count = np.zeros(0, dtype=np.int64)  # rows per key id (0: no unfinished window)
        # distinct batches of the window no longer among ``batches`` (see ``_settle``)
        self.settled = np.zeros(0, dtype=np.int64)
        self.open_batches = np.zeros(0, dtype=np.int64)  # sorted ``_batch_ids`` still buffered
        self.first_ts = np.zeros(0, dtype=np.int64)
        self.last_ts = np.zeros(0, dtype=np.int64)
        self.state = {f.name: np.zeros(0, dtype=f.np_dtype) for f in self.fields}
        self.batches = _EntryStore(_distinct, self._settle)  # key, gateway id, seq
        self.cells = _EntryStore(_summed)  # key, bucket, count

    def _settle(self, entries: _Entries) -> _Entries:
        """Count the batch entries no row can join any more; keep the others.

        A batch none of whose rows is still buffered (``open_batches``) has brought all its
        rows: no later row of a key can come from it, so the key's window will never see it
        again and it is counted in ``settled`` instead of kept (``entries``: distinct, as
        ``_distinct`` leaves them). At many keys nearly every row of a window comes from a
        batch of its own; kept as entries until the window fills they were about one per
        row (millions at 100,000 keys, each sorted again at every consolidation).
        """
        if len(entries) == 0 or not _batch_ids_fit(entries.a, entries.b):
            return entries  # nothing settled: exact, only not smaller
        ids = _batch_ids(entries.a, entries.b)
        known = self.open_batches
        pos = np.minimum(np.searchsorted(known, ids), max(len(known) - 1, 0))
        is_open = known[pos] == ids if len(known) else np.zeros(len(ids), dtype=bool)
        done = entries.key[~is_open]
        if len(done):
            self.settled += np.bincount(done, minlength=len(self.settled))[: len(self.settled)]
        return entries.where(is_open)

    def grow(self, keys: int) -> None:
        """Make room for key ids below ``keys``."""
        extra = keys - len(self.count)
        if extra > 0:
            self.count = np.concatenate((self.count, np.zeros(extra, np.int64)))
            self.settled = np.concatenate((self.settled, np.zeros(extra, np.int64)))
            self.first_ts = np.concatenate((self.first_ts, np.zeros(extra, np.int64)))
            self.last_ts = np.concatenate((self.last_ts, np.zeros(extra, np.int64)))
            self.state = {
                f.name: np.concatenate((self.state[f.name], np.zeros(extra, f.np_dtype)))
                for f in self.fields
            }

    def pack(self) -> dict[str, Any]:
        """For checkpoints (``unpack``)."""
        return {
            "count": self.count.tobytes(),
            "settled": self.settled.tobytes(),
            "first_ts": self.first_ts.tobytes(),
            "last_ts": self.last_ts.tobytes(),
            "state": {name: column.tobytes() for name, column in self.state.items()},
            "batches": self.batches.live().pack(),
            "cells": self.cells.live().pack(),
        }

    def unpack(self, obj: dict[str, Any]) -> None:
        """Inverse of ``pack``."""
        self.count = np.frombuffer(obj["count"], dtype="<i8").copy()
        settled = obj.get("settled")  # absent: written before batches were settled
        self.settled = (
            np.zeros(len(self.count), np.int64)
            if settled is None
            else np.frombuffer(settled, dtype="<i8").copy()
        )
        self.first_ts = np.frombuffer(obj["first_ts"], dtype="<i8").copy()
        self.last_ts = np.frombuffer(obj["last_ts"], dtype="<i8").copy()
        self.state = {
            f.name: np.frombuffer(obj["state"][f.name], dtype=f.np_dtype).copy()
            for f in self.fields
        }
        self.batches.replace(_Entries.unpack(obj["batches"]))
        self.cells.replace(_Entries.unpack(obj["cells"]))
        if any(
            len(c) != len(self.count)
            for c in (self.first_ts, self.last_ts, self.settled, *self.state.values())
        ):
            raise SchemaError("inconsistent count-window state", reason="bad_checkpoint")


class CountState:
    """Rows of one partition's count windows: buffered, in tails, and finished windows."""

    def __init__(self, spec: PipelineSpec, plan: AggregatePlan) -> None:
        self.spec = spec
        self.plan = plan
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self.windows = [w for w in spec.windows if w.by_count]
        self._reset()

    def _reset(self) -> None:
        self._keys = KeyIds()
        self._gateway_ids: dict[str, int] = {}
        self._gateway_names: list[str] = []
        self._pending: list[_Rows] = []
        self._pending_rows = 0  # rows in ``_pending``
        # each buffered chunk's (smallest, largest) ts, by id (the chunk kept with it)
        self._spans: dict[int, tuple[_Rows, int, int]] = {}
        # each buffered chunk's packed form, by id (the chunk kept, so the id stays its own):
        # a chunk stays buffered for about lateness_ms, through several checkpoints
        self._packed: dict[int, tuple[_Rows, Packed]] = {}
        self._tails = [_Unfinished(self.plan.fields) for _ in self.windows]
        self._done = [np.zeros(0, dtype=np.int64) for _ in self.windows]

    def buffered_span(self) -> tuple[int, int] | None:
        """Smallest and largest event time of the buffered rows (None: none)."""
        if not self._pending:
            return None
        spans = [self._span(p) for p in self._pending]
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def _span(self, chunk: _Rows) -> tuple[int, int]:
        """``chunk``'s smallest and largest ts, computed once while it stays buffered."""
        known = self._spans.get(id(chunk))
        if known is None or known[0] is not chunk:
            known = (chunk, int(chunk.ts.min()), int(chunk.ts.max()))
            self._spans[id(chunk)] = known
        return known[1], known[2]

    @property
    def held_cells(self) -> int:
        """What this state holds, in state cells (``max_state_cells``).

        Buffered rows (``ROWS_PER_CELL`` to a cell), each unfinished window's keys and their
        batch and sketch entries, finished window ids.
        """
        held = -(-self._pending_rows // ROWS_PER_CELL) + sum(len(d) for d in self._done)
        for tail in self._tails:
            held += int(np.count_nonzero(tail.count)) + len(tail.batches) + len(tail.cells)
        return held

    @property
    def tail_rows(self) -> int:
        """Final rows waiting for their window to fill (all count windows)."""
        return sum(int(t.count.sum()) for t in self._tails)

    # -- input -------------------------------------------------------------------------------

    def add(
        self, events: EventRows, gateway_id: str, seq: int, keep: npt.NDArray[np.bool_] | None
    ) -> int:
        """Buffer the rows of one batch that ``keep`` marks (on time; None: all); how many.

        Every row is on time, usually: then the columns are taken as they are (event times
        and values not copied, key ids looked up in one pass), not gathered.
        """
        if keep is not None and keep.all():
            keep = None
        picked = None if keep is None else np.flatnonzero(keep)
        n = len(events) if picked is None else len(picked)
        if n == 0:
            return 0
        ids = self._keys.key_ids(events.keys).astype(ROW_DTYPES["key"])
        gateway = self._gateway_ids.setdefault(gateway_id, len(self._gateway_names))
        if gateway == len(self._gateway_names):
            self._gateway_names.append(gateway_id)
        self._pending_rows += n
        ts, row, value = events.ts, events.row, events.value
        self._pending.append(
            _Rows(
                ids[events.key if picked is None else events.key[picked]],
                ts if picked is None else ts[picked],
                _constant(gateway, n, ROW_DTYPES["gateway"]),
                _constant(seq, n, ROW_DTYPES["seq"]),
                (row if picked is None else row[picked]).astype(ROW_DTYPES["row"]),
                value if picked is None else value[picked],
            )
        )
        return n

    # -- closing -----------------------------------------------------------------------------

    def finalise(
        self, threshold: int, span: tuple[int, int], *, flush: bool = False
    ) -> pl.DataFrame:
        """Windows completed by the rows with ``ts < threshold`` (all rows when ``flush``).

        ``span`` is the ``(start, end)`` the results carry (the close step's event-time span:
        each window's last row lies in it). With ``flush``, every key's unfinished window is
        emitted too, with fewer than ``n`` rows.
        """
        final = self._in_event_order(self._take_final(threshold, flush=flush))
        open_batches = self._open_batches()
        for tail in self._tails:
            tail.open_batches = open_batches
        if len(final) == 0 and not flush:
            return self.empty_result()
        frames = [self._fill(i, final, span, flush=flush) for i in range(len(self.windows))]
        frames = [f for f in frames if f.height]
        return pl.concat(frames) if frames else self.empty_result()

    def _take_final(self, threshold: int, *, flush: bool) -> list[_Rows]:
        """The buffered rows with ``ts < threshold`` (all when ``flush``), as chunks."""
        if flush:
            final, self._pending = self._pending, []
            self._pending_rows = 0
            self._spans = {}
            return final
        taken: list[_Rows] = []
        kept: list[_Rows] = []
        for chunk in self._pending:
            low, high = self._span(chunk)
            if low >= threshold:  # most of the buffer: nothing of it final yet
                kept.append(chunk)
                continue
            if high < threshold:
                taken.append(chunk)
                continue
            is_final = chunk.ts < threshold
            if is_final.all():
                taken.append(chunk)
            elif is_final.any():
                taken.append(chunk.take(is_final))
                kept.append(chunk.take(~is_final))
            else:
                kept.append(chunk)
        self._pending = kept
        self._pending_rows = sum(len(c) for c in kept)
        spans = self._spans
        self._spans = {id(c): spans[id(c)] for c in kept if id(c) in spans}
        return taken

    def _open_batches(self) -> Int64Array:
        """``_batch_ids`` of the batches with rows still buffered, sorted.

        Every buffered chunk is rows of one batch (``add``; ``_take_final`` splits chunks,
        never joins them), so its first row names it.
        """
        if not self._pending:
            return np.zeros(0, dtype=np.int64)
        gateway = np.array([int(c.gateway[0]) for c in self._pending], dtype=np.int64)
        seq = np.array([int(c.seq[0]) for c in self._pending], dtype=np.int64)
        return np.unique(_batch_ids(gateway, seq))

    def _gateway_ranks(self) -> Int64Array:
        """Per gateway id, its rank among the gateways' names (``COUNT_ORDER`` sorts by name)."""
        names = self._gateway_names
        rank = np.empty(len(names), dtype=np.int64)
        rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
        return rank

    def _in_event_order(self, chunks: list[_Rows]) -> _Final:
        """Buffered chunks as one set of rows sorted by key, then ``COUNT_ORDER``.

        Each chunk is one batch's rows (one gateway and seq) in row order, as ``add`` buffers
        them. Concatenated in (gateway name, seq) order, the rows are in (gateway, seq, row)
        order already, so one sort by (key, ts), packed into one int64 with the position as
        tie-break, gives the order ``_event_order``'s five-key ``lexsort`` does (which it
        falls back to for chunks of another shape, or spans that do not pack).
        """
        chunks = [c for c in chunks if len(c)]
        rank = self._gateway_ranks()
        batches = [(int(rank[c.gateway[0]]), int(c.seq[0])) for c in chunks]
        if not all(_one_batch(c) for c in chunks) or len(set(batches)) != len(batches):
            rows = _Rows.concat(chunks)
            return _Final.of(rows.take(self._event_order(rows)))
        by_batch = sorted(range(len(chunks)), key=batches.__getitem__)
        ordered = [chunks[i] for i in by_batch]
        fast = _by_key_ts(ordered) if ordered else _Final.of(_Rows.empty())
        if fast is not None:
            return fast
        rows = _Rows.concat(ordered)  # spans that do not pack with the positions
        order = _key_ts_order(rows)
        return _Final.of(rows if order is None else rows.take(order))

    def _event_order(self, rows: _Rows) -> Int64Array:
        """Positions of ``rows`` sorted by key, then ``COUNT_ORDER`` (gateways by name)."""
        rank = self._gateway_ranks()
        order: Int64Array = np.lexsort(
            (
                rows.row,
                rows.seq,
                rank[rows.gateway] if len(rank) else rows.gateway,
                rows.ts,
                rows.key,
            )
        )
        return order

    def _fill(
        self, index: int, final: _Final, span: tuple[int, int], *, flush: bool
    ) -> pl.DataFrame:
        """Fold final rows (sorted by key, in event order) into window ``index``; full windows.

        Each key's new rows are numbered on from its unfinished window's count (``_number``):
        they finish that window, fill whole windows, and the rest is the key's new unfinished
        window. Every window here is one *group*; its state comes from the registry's
        kernels over its new rows (``partial_state``), merged with the unfinished window it
        continues (``merge_state``): the same code that computes and merges partials.
        """
        held = self._tails[index]
        held.grow(len(self._keys))
        n = self.windows[index].count
        g = _number(held, final, n, flush=flush)
        state, cells = self._merged(held, final, g)
        complete = np.ones(g.size, dtype=bool) if flush else g.total == n
        # Unfinished windows finished here give up their entries; continued ones keep them.
        finishing = g.from_held[complete[g.from_held]]
        group_of = np.full(len(held.count), -1, dtype=np.int64)
        group_of[g.keys[finishing]] = finishing
        taken = np.sort(g.keys[finishing])
        batches = _row_batches(final, g)  # (group, gateway, seq), distinct
        state[BATCHES.name] = _batch_counts(batches, held.batches.take(taken), group_of, g.size)
        state[BATCHES.name][finishing] += held.settled[g.keys[finishing]]
        done_cells = None
        if cells is not None:
            held_cells = held.cells.take(taken)
            ids = cell_ids(group_of[held_cells.key], held_cells.a)
            in_done = complete[cell_groups(cells[0])]
            done_cells = merge_cells(
                np.concatenate((cells[0][in_done], ids)),
                np.concatenate((cells[1][in_done], held_cells.b)),
            )
        _keep_open(held, g, state, cells, batches, ~complete)
        return self._finished(index, g, state, done_cells, complete, span)

    def _finished(  # noqa: PLR0917 - private; one call site
        self,
        index: int,
        g: _Groups,
        state: dict[str, npt.NDArray[Any]],
        cells: tuple[Int64Array, Int64Array] | None,
        complete: npt.NDArray[np.bool_],
        span: tuple[int, int],
    ) -> pl.DataFrame:
        """The results of the complete groups, by key and ordinal; counts them as finished.

        ``cells``: the complete groups' sketch cells (sorted ids, counts), or None.
        """
        done_groups = np.flatnonzero(complete)
        if len(done_groups) == 0:
            return self.empty_result()
        done_groups = done_groups[np.lexsort((g.local[done_groups], g.keys[done_groups]))]
        keys = g.keys[done_groups]
        done = self._done_counts(index)
        ordinal = done[keys] + g.local[done_groups]
        np.add.at(done, keys, 1)
        self._done[index] = done
        quantiles: list[npt.NDArray[np.float64]] = []
        if cells is not None:
            ids, counts = cells
            # quantile_buckets wants cells by group in result order: renumber the groups
            rank_of = np.zeros(g.size, dtype=np.int64)
            rank_of[done_groups] = np.arange(len(done_groups))
            ids = cell_ids(rank_of[cell_groups(ids)], cell_buckets(ids))
            order = np.argsort(ids, kind="stable")
            wanted = list(self.plan.quantiles.values())
            ranks = np.arange(len(done_groups), dtype=np.int64)
            quantiles = QUANTILES.finalize(self.buckets, ids[order], counts[order], ranks, wanted)
        frame = pl.DataFrame(
            {
                "window": pl.repeat(self.windows[index].name, len(done_groups), eager=True),
                "start": np.full(len(done_groups), span[0], dtype=np.int64),
                "end": np.full(len(done_groups), span[1], dtype=np.int64),
                "key": self._keys.keys_of(keys),
                **{f: state[f][done_groups] for f in self.plan.field_names},
                **dict(zip(self.plan.quantiles, quantiles, strict=True)),
                "index": ordinal,
                "first_ts": g.first_ts[done_groups],
                "last_ts": g.last_ts[done_groups],
            },
            schema_overrides={f.name: f.dtype for f in self.plan.fields},
        )
        frame = self.plan.with_eager_outputs(frame)
        return frame.select(*result_columns(self.spec, self.plan), *RESULT_EXTRAS)

    def _merged(
        self, held: _Unfinished, final: _Final, g: _Groups
    ) -> tuple[dict[str, npt.NDArray[Any]], tuple[Int64Array, Int64Array] | None]:
        """Each group's state: its new rows', merged with the unfinished window it continues.

        Returns the fields (aligned with groups ``0 .. size - 1``) and the new rows' sketch
        cells (sorted ids by group, with their counts; None without quantiles).
        """
        fields = self.plan.fields
        if len(final):
            bucket = self.buckets.keys_np(final.value) if self.plan.needs_sketch else None
            sort = GroupSort(g.group, None, g.starts, g.lengths, np.arange(len(g.starts)))
            new, state, sketch = partial_state(
                g.group, final.ts, final.value, fields, bucket, sort=sort
            )
        else:  # flushing unfinished windows only
            nothing = np.zeros(0, dtype=np.int64)
            new, state = nothing, {f.name: np.zeros(0, dtype=f.np_dtype) for f in fields}
            sketch = (nothing, nothing, nothing) if self.plan.needs_sketch else None
        if len(g.from_held):
            held_keys = g.keys[g.from_held]
            # an unfinished window's state first: it holds the group's earlier rows
            ids = np.concatenate((g.from_held, new))
            columns = {
                f.name: np.concatenate((held.state[f.name][held_keys], state[f.name]))
                for f in fields
            }
            _, state = merge_state(ids, columns, fields)
        if sketch is None:
            return state, None
        return state, (cell_ids(new[sketch[0]], sketch[1]), sketch[2])

    def _done_counts(self, index: int) -> Int64Array:
        done = self._done[index]
        if len(done) < len(self._keys):
            done = np.concatenate((done, np.zeros(len(self._keys) - len(done), np.int64)))
        return done

    def empty_result(self) -> pl.DataFrame:
        """A results frame with no rows (the schema of every ``finalise`` frame)."""
        schema = result_schema(self.spec)
        schema.update(dict.fromkeys(RESULT_EXTRAS, pl.Int64()))
        return pl.DataFrame(schema=schema)

    # -- checkpoints -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Keys, gateways, buffered rows, unfinished windows' state, finished-window counts.

        For ``_packing.parts``: the buffered rows come packed already (``Packed``), their
        columns by reference (most of a checkpoint: ~55 MB at 2M measurements/s, copied
        into a packer's buffer at every checkpoint otherwise).
        """
        return {
            "v": COUNT_SNAPSHOT_VERSION,
            "keys": self._keys.names,
            "gateways": self._gateway_names,
            "pending": self._packed_pending(),
            "unfinished": [t.pack() for t in self._tails],
            "done": [self._done_counts(i).tobytes() for i in range(len(self.windows))],
        }

    def _packed_pending(self) -> Packed:
        """The buffered chunks packed; each chunk once, while it stays buffered."""
        known = self._packed
        self._packed = {
            id(c): (c, known[id(c)][1] if id(c) in known else self._pack(c)) for c in self._pending
        }
        return Packed.array([packed for _, packed in self._packed.values()])

    def _pack(self, chunk: _Rows) -> Packed:
        """``chunk`` packed (``_Rows.pack``), its columns by reference."""
        return Packed.map(chunk.pack(self._span(chunk)))

    def restore(self, obj: dict[str, Any] | None) -> None:
        """Replace everything with a ``snapshot`` (None: start empty).

        A snapshot of the first layout (``tails``: unfinished windows as rows) is folded.
        """
        self._reset()
        if obj is None:
            return
        try:
            self._keys.clear(list(obj["keys"]))
            self._gateway_names = list(obj["gateways"])
            self._gateway_ids = {g: i for i, g in enumerate(self._gateway_names)}
            self._pending = [_Rows.unpack(p) for p in obj["pending"]]
            self._pending_rows = sum(len(p) for p in self._pending)
            done = [np.frombuffer(d, dtype="<i8").copy() for d in obj["done"]]
            held = obj.get("unfinished")
            rows = (
                None
                if held is not None
                else [_Rows.concat([_Rows.unpack(c) for c in t]) for t in obj["tails"]]
            )
            if held is not None and len(held) == len(self._tails):
                for tails, packed in zip(self._tails, held, strict=True):
                    tails.unpack(packed)
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(
                f"unreadable count-window checkpoint: {exc}", reason="bad_checkpoint"
            ) from exc
        found = len(held) if held is not None else len(rows or [])
        if found != len(self.windows) or len(done) != len(self.windows):
            raise SchemaError("count-window checkpoint of another spec", reason="bad_checkpoint")
        self._done = done
        for index, tail in enumerate(rows or []):  # fewer than n rows a key: none finishes
            self._fill(index, _Final.of(tail.take(self._event_order(tail))), (0, 0), flush=False)
            self._done[index] = done[index]


@dataclass(frozen=True, slots=True)
class _Groups:
    """The windows one close step touches in one count window, numbered ``0 .. size - 1``.

    Groups with new rows come first, by key and ordinal (``group``: each new row's); then,
    when flushing, the unfinished windows of keys without new rows.
    """

    group: Int64Array
    """Group of each new row (ascending)."""
    starts: Int64Array
    """First new row of each group with new rows."""
    lengths: Int64Array
    """New rows of each group with new rows."""
    keys: Int64Array
    """Key id of each group."""
    local: Int64Array
    """Ordinal of each group among its key's windows after the finished ones (0: the one
    its unfinished window continues)."""
    from_held: Int64Array
    """Groups that continue (or, flushing, are) an unfinished window."""
    touched: npt.NDArray[np.bool_]
    """Per key id, whether its unfinished window is finished or continued here."""
    total: Int64Array
    """Rows of each group, the unfinished window's included."""
    first_ts: Int64Array
    last_ts: Int64Array

    @property
    def size(self) -> int:
        """Number of groups."""
        return len(self.keys)


def _number(held: _Unfinished, final: _Final, n: int, *, flush: bool) -> _Groups:
    """Number final rows (sorted by key, in event order) into windows of ``n`` per key.

    A key's rows continue its unfinished window (``held.count`` rows so far); flushing, the
    unfinished windows of keys without new rows are groups too.
    """
    keys = len(held.count)
    starts, lengths = run_bounds(final.key)  # one run per key
    run_keys = final.key[starts].astype(np.int64)
    before = held.count[run_keys]  # rows of the key's unfinished window
    first_local = before // n
    per_run = (before + lengths - 1) // n - first_local + 1  # windows each run touches
    run_of = np.repeat(np.arange(len(starts), dtype=np.int64), per_run)  # per group
    ordinal = gather_runs(np.zeros(len(per_run), dtype=np.int64), per_run)  # 0.. in each run
    local = first_local[run_of] + ordinal
    # a run's first group starts with it; a later one where its window's first row falls
    first = starts[run_of] + np.where(ordinal == 0, 0, n * local - before[run_of])
    last = np.concatenate((first[1:], [len(final)]))[: len(first)].astype(np.int64) - 1
    new_keys = run_keys[run_of]
    touched = np.zeros(keys, dtype=bool)
    touched[run_keys] = True
    extra = np.flatnonzero((held.count > 0) & ~touched) if flush else np.zeros(0, np.int64)
    if flush:
        touched[:] = True
    size = len(first) + len(extra)
    carried = (local == 0) & (before[run_of] > 0)
    from_held = np.concatenate((np.flatnonzero(carried), np.arange(len(first), size)))
    all_keys = np.concatenate((new_keys, extra))
    held_keys = all_keys[from_held]
    rows = last - first + 1
    total = np.concatenate((rows, np.zeros(len(extra), np.int64)))
    total[from_held] += held.count[held_keys]
    first_ts = np.concatenate((final.ts[first], np.zeros(len(extra), np.int64)))
    first_ts[from_held] = held.first_ts[held_keys]
    return _Groups(
        group=np.repeat(np.arange(len(first), dtype=np.int64), rows),
        starts=first,
        lengths=rows,
        keys=all_keys,
        local=np.concatenate((local, np.zeros(len(extra), np.int64))),
        from_held=from_held,
        touched=touched,
        total=total,
        first_ts=first_ts,
        last_ts=np.concatenate((final.ts[last], held.last_ts[extra])),
    )


def _one_batch(chunk: _Rows) -> bool:
    """Whether ``chunk`` holds rows of one batch only (one gateway and seq), in row order."""
    if len(chunk) < 2:
        return True
    return bool(
        _constant_column(chunk.gateway)
        and _constant_column(chunk.seq)
        and (chunk.row[1:] > chunk.row[:-1]).all()
    )


def _constant_column(column: npt.NDArray[Any]) -> bool:
    """Whether every value of ``column`` (not empty) is its first (at once for ``_constant``)."""
    return column.strides == (0,) or bool((column == column[0]).all())


def _key_ts_bits(key: npt.NDArray[Any], ts: Int64Array) -> tuple[int, int, int] | None:
    """(lowest ts, bits of the key, bits of the ts offset) to pack (key, ts) into an int64.

    None when a key is negative (it does not pack).
    """
    if int(key.min()) < 0:
        return None
    low = int(ts.min())
    return low, max(1, int(key.max()).bit_length()), max(1, (int(ts.max()) - low).bit_length())


def _key_ts_order(rows: _Rows) -> Int64Array | None:
    """A stable order of ``rows`` by (key, ts) (None: already in it).

    (key, ts, position) packed into one int64 when they fit (one unstable sort of unique
    values); else a stable argsort of (key, ts) packed; else a two-key ``lexsort``.
    """
    n = len(rows)
    if n < 2:
        return None
    key = rows.key.astype(np.int64)
    span = _key_ts_bits(key, rows.ts)
    if span is None or span[1] + span[2] > 63:
        by_two: Int64Array = np.lexsort((rows.ts, key))
        return by_two
    low, bits_key, bits_ts = span
    packed = (key << bits_ts) | (rows.ts - low)
    if (packed[1:] >= packed[:-1]).all():
        return None
    bits_pos = (n - 1).bit_length()
    if bits_key + bits_ts + bits_pos <= 63:
        sorted_ = np.sort((packed << bits_pos) | np.arange(n, dtype=np.int64))
        result: Int64Array = sorted_ & ((1 << bits_pos) - 1)
        return result
    stable: Int64Array = np.argsort(packed, kind="stable")
    return stable


def _by_key_ts(chunks: list[_Rows]) -> _Final | None:
    """The rows of ``chunks`` (one batch each, distinct, not empty) stably sorted by (key, ts).

    ``_key_ts_order``'s packed sort, without gathering the columns afterwards: key and ts
    are read back from the sorted int64 itself, the value is gathered by the position in
    its low bits, the batch number from the chunks' (a chunk is one batch). At 600,000 rows
    a close step, gathering the columns in key order cost as much as the sort itself; the
    packed integers are built in place (each new array is fresh memory to map and zero).
    None when (key, ts offset, position) do not fit 63 bits.
    """
    key = np.concatenate([c.key for c in chunks])
    ts = np.concatenate([c.ts for c in chunks])
    n = len(ts)
    span = _key_ts_bits(key, ts)
    bits_pos = max(1, (n - 1).bit_length())
    if span is None or span[1] + span[2] + bits_pos > 63:
        return None
    low, _, bits_ts = span
    packed = key.astype(np.int64)
    packed <<= bits_ts
    packed += ts  # the low bits are zero: + is |
    packed -= low
    packed <<= bits_pos
    packed |= np.arange(n, dtype=np.int64)
    if n > 1 and not (packed[1:] > packed[:-1]).all():
        packed.sort()
    position = packed & ((1 << bits_pos) - 1)
    value = np.concatenate([c.value for c in chunks])[position]
    gateways = np.array([int(c.gateway[0]) for c in chunks], dtype=np.int64)
    seqs = np.array([int(c.seq[0]) for c in chunks], dtype=np.int64)
    by_batch = np.lexsort((seqs, gateways))  # number the batches in (gateway id, seq) order
    number = np.empty(len(chunks), dtype=np.int32)
    number[by_batch] = np.arange(len(chunks), dtype=np.int32)
    batch = np.repeat(number, [len(c) for c in chunks])[position]
    packed >>= bits_pos
    sorted_ts = packed & ((1 << bits_ts) - 1)
    sorted_ts += low
    packed >>= bits_ts
    key = packed.astype(ROW_DTYPES["key"])
    return _Final(key, sorted_ts, value, batch, gateways[by_batch], seqs[by_batch])


DENSE_BATCH_CELLS_PER_ROW: Final = 2
"""A step's (group, batch) grid up to this many cells a row is marked in a mask, not sorted."""


def _row_batches(final: _Final, g: _Groups) -> _Entries:
    """The distinct (group, gateway, seq) of the new rows (``key``: the group), sorted.

    Each row's (group, batch number) is one integer of a grid ``groups x batches``; a step
    has some tens of batches, so the grid is marked in a mask of about a byte a row (a sort
    where it would be larger). Batch numbers follow (gateway id, seq): the cells come out in
    (group, gateway, seq) order, as ``_distinct`` leaves entries.
    """
    width = len(final.gateways)
    if len(final) == 0:
        return _Entries.empty()
    cells = g.group * width
    cells += final.batch
    if g.size * width <= DENSE_BATCH_CELLS_PER_ROW * len(final):
        seen = np.zeros(g.size * width, dtype=bool)
        seen[cells] = True
        cells = np.flatnonzero(seen)
    else:
        cells = np.unique(cells[np.concatenate(([True], cells[1:] != cells[:-1]))])
    group = cells // width
    number = cells - group * width
    return _Entries(group.astype(np.int32), final.gateways[number], final.seqs[number])


def _batch_counts(
    batches: _Entries, held: _Entries, group_of: Int64Array, groups: int
) -> Int64Array:
    """Distinct batches per group.

    Its new rows' and, for a group finishing an unfinished window, that window's (``held``,
    by key; ``group_of`` maps those keys to their groups).
    """
    mine = _Entries(group_of[held.key].astype(np.int32), held.a, held.b)
    both = _distinct(_Entries.concat([batches, mine]))
    return np.bincount(both.key, minlength=groups).astype(np.int64)


def _keep_open(  # noqa: PLR0917 - private; one call site
    held: _Unfinished,
    g: _Groups,
    state: dict[str, npt.NDArray[Any]],
    cells: tuple[Int64Array, Int64Array] | None,
    batches: _Entries,
    is_open: npt.NDArray[np.bool_],
) -> None:
    """The groups left open become their keys' unfinished windows; the others' are gone."""
    open_ = np.flatnonzero(is_open)
    keys = g.keys[open_]
    continued = np.zeros(g.size, dtype=bool)
    continued[g.from_held] = True
    settled = np.where(continued[open_], held.settled[keys], 0)
    held.settled[g.touched] = 0
    held.settled[keys] = settled
    held.count[g.touched] = 0
    held.count[keys] = g.total[open_]
    held.first_ts[keys] = g.first_ts[open_]
    held.last_ts[keys] = g.last_ts[open_]
    for name, column in state.items():
        held.state[name][keys] = column[open_]
    keep = is_open[batches.key]
    held.batches.add(
        _Entries(g.keys[batches.key[keep]].astype(np.int32), batches.a[keep], batches.b[keep])
    )
    if cells is not None:
        group = cell_groups(cells[0])
        keep = is_open[group]
        held.cells.add(
            _Entries(
                g.keys[group[keep]].astype(np.int32), cell_buckets(cells[0][keep]), cells[1][keep]
            )
        )
