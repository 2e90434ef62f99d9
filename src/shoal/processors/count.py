"""Count windows at the combiner: rows wait until their order is final, then fill windows of n.

A count window is every ``n`` rows of a key in event order ``(ts, gateway, seq, row)``
(``windows.COUNT_ORDER``). Workers ship rows (``partials.EventRows``), not state. A row's
rank within its key is final once every row that could come before it has been applied: once
the close threshold (pipeline watermark minus ``lateness_ms``) has passed its timestamp,
because a row applied later with a smaller timestamp is late (``combine``). So:

1. ``add`` buffers a batch's on-time rows (with its gateway and seq).
2. ``finalise(threshold)`` takes the buffered rows with ``ts < threshold``, sorts them in
   event order per key and appends them, per count window, to the key's *tail* (final rows
   not yet in a full window, all of which come before them). Every run of ``n`` rows is a
   window: its aggregates come from the registry's kernels (``_kernels.partial_state`` over
   the window's raw rows, the same code that computes a batch's partial state, then the
   aggregates' finalisers and the sketch's quantiles), its ordinal within the key from the
   key's count of finished windows. The rest becomes the new tail.
3. ``finalise(..., flush=True)`` (end of stream) also emits every tail as a window with
   fewer than ``n`` rows.

Memory: the buffer holds the rows not yet final (about ``lateness_ms`` plus the watermark's
lag worth of input), the tails at most ``n - 1`` live rows per key and count window, 36 bytes
a row (``ROW_DTYPES``), in chunks that are consolidated before dead rows outweigh live ones
(``_Tails``). Everything is in numpy arrays; nothing loops over rows in Python (keys only
when a key list is first seen).

Imports ``partials`` (rows), ``state`` (the results layout), ``aggregates``/``_kernels``/
``sketch`` (the registry); never I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import SchemaError
from shoal.processors._kernels import cell_ids, gather_runs, partial_state, run_bounds
from shoal.processors.aggregates import BATCHES, QUANTILES, AggregatePlan
from shoal.processors.partials import EventRows
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import KeyIds, result_columns, result_schema

Int64Array = npt.NDArray[np.int64]

RESULT_EXTRAS: Final = ("index", "first_ts", "last_ts")
"""Per-key columns count-window results carry besides the usual ones (all Int64)."""

ROW_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "key": np.dtype("<i4"),
    "ts": np.dtype("<i8"),
    "gateway": np.dtype("<i4"),
    "seq": np.dtype("<i8"),
    "row": np.dtype("<i4"),
    "value": np.dtype("<f8"),
}
"""Column types of held rows: 36 bytes a row (key ids < 2**24, rows in a batch < 2**31)."""


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
        """The rows at ``index`` (positions or a mask)."""
        return _Rows(*(getattr(self, f.name)[index] for f in fields(self)))

    @classmethod
    def empty(cls) -> _Rows:
        """No rows."""
        return cls(**{name: np.zeros(0, dtype=dtype) for name, dtype in ROW_DTYPES.items()})

    @classmethod
    def concat(cls, parts: list[_Rows]) -> _Rows:
        """All rows of ``parts``, in order."""
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def pack(self) -> dict[str, bytes]:
        """Raw little-endian buffers (checkpoints)."""
        return {f.name: getattr(self, f.name).tobytes() for f in fields(self)}

    @classmethod
    def unpack(cls, obj: dict[str, bytes]) -> _Rows:
        """Inverse of ``pack``."""
        cols = {name: np.frombuffer(obj[name], dtype=dtype) for name, dtype in ROW_DTYPES.items()}
        if len({len(c) for c in cols.values()}) != 1:
            raise SchemaError("inconsistent count-window rows", reason="bad_checkpoint")
        return cls(**{k: v.copy() for k, v in cols.items()})


MAX_TAIL_CHUNKS: Final = 1024
"""Chunks of tail rows kept at most (each ``take`` looks into every one)."""


@dataclass(slots=True)
class _Chunk:
    """Tail rows added in one step, sorted by key: one run ``lo[i]:hi[i]`` per key ``keys[i]``.

    A key's run dies (``alive``) when the key fills a window and its rows are taken out.
    """

    rows: _Rows
    keys: npt.NDArray[np.int32]
    lo: Int64Array
    hi: Int64Array
    alive: npt.NDArray[np.bool_]

    @classmethod
    def of(cls, rows: _Rows) -> _Chunk:
        """A chunk of rows sorted by key."""
        lo, lengths = run_bounds(rows.key)
        return cls(rows, rows.key[lo], lo, lo + lengths, np.ones(len(lo), dtype=bool))

    def take(self, keys: Int64Array) -> _Rows | None:
        """The rows of those of ``keys`` (sorted) whose runs are alive here; kills them."""
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = (self.keys[pos] == keys) & self.alive[pos]
        runs = pos[hit]
        if len(runs) == 0:
            return None
        self.alive[runs] = False
        return self.rows.take(gather_runs(self.lo[runs], self.hi[runs] - self.lo[runs]))

    def live(self) -> _Rows:
        """Every row of a live run."""
        if self.alive.all():
            return self.rows
        runs = np.flatnonzero(self.alive)
        return self.rows.take(gather_runs(self.lo[runs], self.hi[runs] - self.lo[runs]))


class _Tails:
    """One count window's unfinished windows: each key's final rows not yet in a full window.

    Kept in chunks (one a step), so that a step costs what it adds and what it completes, not
    everything the tails hold: a key's rows leave all at once, when it fills a window
    (``take``), and per key the chunks' order is event order.
    """

    def __init__(self) -> None:
        self.chunks: list[_Chunk] = []
        self.count = np.zeros(0, dtype=np.int64)  # live rows per key id

    def grow(self, keys: int) -> None:
        """Make room for key ids below ``keys``."""
        if len(self.count) < keys:
            self.count = np.concatenate((self.count, np.zeros(keys - len(self.count), np.int64)))

    def add(self, rows: _Rows) -> None:
        """Append rows sorted by key (each key's after its earlier ones)."""
        if len(rows) == 0:
            return
        self.chunks.append(_Chunk.of(rows))
        self.count += np.bincount(rows.key, minlength=len(self.count))
        self._consolidate()

    def _consolidate(self) -> None:
        """One chunk of the live rows when dead ones hold as much memory, or chunks abound.

        A chunk is freed once every key in it has filled a window; a key that stops sending
        would keep its chunks alive forever without this. So memory stays below twice the
        live rows, at an O(tail) pass every time the tails have turned over once.
        """
        live = int(self.count.sum())
        held = sum(len(c.rows) for c in self.chunks)  # live or dead
        if held > 2 * live + 65_536 or len(self.chunks) > MAX_TAIL_CHUNKS:
            rows = self.all()
            self.chunks = [_Chunk.of(rows)] if len(rows) else []

    def take(self, keys: Int64Array) -> _Rows:
        """Take out every row of ``keys`` (sorted, unique): sorted by key, in event order."""
        parts = [r for r in (c.take(keys) for c in self.chunks) if r is not None]
        self.chunks = [c for c in self.chunks if c.alive.any()]
        self.count[keys] = 0
        rows = _Rows.concat(parts)
        return rows.take(np.argsort(rows.key, kind="stable")) if len(parts) > 1 else rows

    def all(self) -> _Rows:
        """Every row, sorted by key, in event order."""
        rows = self.unsorted()
        return rows.take(np.argsort(rows.key, kind="stable"))

    def unsorted(self) -> _Rows:
        """Every row, each key's in event order but keys interleaved (``all`` sorts them)."""
        return _Rows.concat([c.live() for c in self.chunks])


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
        self._tails = [_Tails() for _ in self.windows]
        self._done = [np.zeros(0, dtype=np.int64) for _ in self.windows]

    def buffered_span(self) -> tuple[int, int] | None:
        """Smallest and largest event time of the buffered rows (None: none)."""
        if not self._pending:
            return None
        return min(int(p.ts.min()) for p in self._pending), max(
            int(p.ts.max()) for p in self._pending
        )

    @property
    def tail_rows(self) -> int:
        """Final rows waiting for their window to fill (all count windows)."""
        return sum(int(t.count.sum()) for t in self._tails)

    # -- input -------------------------------------------------------------------------------

    def add(self, events: EventRows, gateway_id: str, seq: int, keep: npt.NDArray[np.bool_]) -> int:
        """Buffer the rows of one batch that ``keep`` marks (on time); how many."""
        picked = np.flatnonzero(keep)
        if len(picked) == 0:
            return 0
        keys = self._keys.key_ids(events.keys)[events.key[picked]].astype(np.int32)
        gateway = self._gateway_ids.setdefault(gateway_id, len(self._gateway_names))
        if gateway == len(self._gateway_names):
            self._gateway_names.append(gateway_id)
        n = len(picked)
        self._pending.append(
            _Rows(
                keys,
                events.ts[picked],
                np.full(n, gateway, dtype=np.int32),
                np.full(n, seq, dtype=np.int64),
                events.row[picked].astype(np.int32),
                events.value[picked],
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
        final = self._take_final(threshold, flush=flush)
        if len(final) == 0 and not flush:
            return self.empty_result()
        final = final.take(self._event_order(final))
        frames = [self._fill(i, final, span, flush=flush) for i in range(len(self.windows))]
        frames = [f for f in frames if f.height]
        return pl.concat(frames) if frames else self.empty_result()

    def _take_final(self, threshold: int, *, flush: bool) -> _Rows:
        if flush:
            final, self._pending = _Rows.concat(self._pending), []
            return final
        taken: list[_Rows] = []
        kept: list[_Rows] = []
        for chunk in self._pending:
            is_final = chunk.ts < threshold
            if is_final.all():
                taken.append(chunk)
            elif is_final.any():
                taken.append(chunk.take(is_final))
                kept.append(chunk.take(~is_final))
            else:
                kept.append(chunk)
        self._pending = kept
        return _Rows.concat(taken)

    def _event_order(self, rows: _Rows) -> Int64Array:
        """Positions of ``rows`` sorted by key, then ``COUNT_ORDER`` (gateways by name)."""
        names = self._gateway_names
        rank = np.empty(len(names), dtype=np.int64)
        rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
        order: Int64Array = np.lexsort(
            (
                rows.row,
                rows.seq,
                rank[rows.gateway] if len(names) else rows.gateway,
                rows.ts,
                rows.key,
            )
        )
        return order

    def _fill(
        self, index: int, final: _Rows, span: tuple[int, int], *, flush: bool
    ) -> pl.DataFrame:
        """Append final rows (in event order) to window ``index``'s tails; its full windows."""
        n = self.windows[index].count
        tails = self._tails[index]
        tails.grow(len(self._keys))
        total = tails.count + np.bincount(final.key, minlength=len(tails.count))
        ready = np.flatnonzero(total > 0 if flush else total >= n)
        if len(ready) == 0:
            tails.add(final)
            return self.empty_result()
        is_ready = np.zeros(len(tails.count), dtype=bool)
        is_ready[ready] = True
        fresh = is_ready[final.key]
        tails.add(final.take(~fresh))
        # The keys that fill a window: their tail rows come before their new ones.
        rows = _Rows.concat([tails.take(ready), final.take(fresh)])
        rows = rows.take(np.argsort(rows.key, kind="stable"))
        starts, lengths = run_bounds(rows.key)
        rank = np.arange(len(rows)) - np.repeat(starts, lengths)
        local = rank // n
        full_rows = (lengths // n) * n  # rows per key in full windows
        complete = rank < np.repeat(full_rows, lengths)
        if flush:
            complete[:] = True
        tails.add(rows.take(~complete))
        done_rows = rows.take(complete)
        if len(done_rows) == 0:
            return self.empty_result()
        local = local[complete]
        done = self._done_counts(index)
        ordinal = done[done_rows.key] + local
        # one window per (key, ordinal); rows are sorted by key then rank, so ids ascend
        change = np.concatenate(
            ([True], (done_rows.key[1:] != done_rows.key[:-1]) | (ordinal[1:] != ordinal[:-1]))
        )
        group = np.cumsum(change) - 1
        first = np.flatnonzero(change)
        last = np.concatenate((first[1:], [len(done_rows)])) - 1
        keys_of = done_rows.key[first]
        np.add.at(done, keys_of, 1)
        self._done[index] = done
        return self._results(index, group, done_rows, first, last, ordinal[first], span)

    def _done_counts(self, index: int) -> Int64Array:
        done = self._done[index]
        if len(done) < len(self._keys):
            done = np.concatenate((done, np.zeros(len(self._keys) - len(done), np.int64)))
        return done

    def _results(  # noqa: PLR0917 - private; one call site
        self,
        index: int,
        group: Int64Array,
        rows: _Rows,
        first: Int64Array,
        last: Int64Array,
        ordinal: Int64Array,
        span: tuple[int, int],
    ) -> pl.DataFrame:
        """Finalise windows from their raw rows with the registry's kernels and finalisers."""
        bucket = self.buckets.keys_np(rows.value) if self.plan.needs_sketch else None
        groups, state, sketch = partial_state(group, rows.ts, rows.value, self.plan.fields, bucket)
        state[BATCHES.name] = _distinct_batches(group, rows.gateway, rows.seq, len(groups))
        quantiles: list[npt.NDArray[np.float64]] = []
        if sketch is not None:
            cells = cell_ids(groups[sketch[0]], sketch[1])
            wanted = list(self.plan.quantiles.values())
            quantiles = QUANTILES.finalize(self.buckets, cells, sketch[2], groups, wanted)
        frame = pl.DataFrame(
            {
                "window": pl.repeat(self.windows[index].name, len(groups), eager=True),
                "start": np.full(len(groups), span[0], dtype=np.int64),
                "end": np.full(len(groups), span[1], dtype=np.int64),
                "key": self._keys.keys_of(rows.key[first]),
                **{f: state[f] for f in self.plan.field_names},
                **dict(zip(self.plan.quantiles, quantiles, strict=True)),
                "index": ordinal,
                "first_ts": rows.ts[first],
                "last_ts": rows.ts[last],
            },
            schema_overrides={f.name: f.dtype for f in self.plan.fields},
        )
        return frame.select(*result_columns(self.spec, self.plan), *RESULT_EXTRAS)

    def empty_result(self) -> pl.DataFrame:
        """A results frame with no rows (the schema of every ``finalise`` frame)."""
        schema = result_schema(self.spec)
        schema.update(dict.fromkeys(RESULT_EXTRAS, pl.Int64()))
        return pl.DataFrame(schema=schema)

    # -- checkpoints -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Keys, gateways, buffered rows, tails and finished-window counts (for MsgPack).

        Buffers are packed once, by the caller's checkpoint; tails are not sorted here
        (``restore`` does), as a checkpoint is taken every second and restored rarely.
        """
        return {
            "keys": self._keys.names,
            "gateways": self._gateway_names,
            "pending": [p.pack() for p in self._pending],
            "tails": [[c.live().pack() for c in t.chunks] for t in self._tails],
            "done": [self._done_counts(i).tobytes() for i in range(len(self.windows))],
        }

    def restore(self, obj: dict[str, Any] | None) -> None:
        """Replace everything with a ``snapshot`` (None: start empty)."""
        self._reset()
        if obj is None:
            return
        try:
            self._keys.clear(list(obj["keys"]))
            self._gateway_names = list(obj["gateways"])
            self._gateway_ids = {g: i for i, g in enumerate(self._gateway_names)}
            self._pending = [_Rows.unpack(p) for p in obj["pending"]]
            tail_rows = [_Rows.concat([_Rows.unpack(c) for c in t]) for t in obj["tails"]]
            done = [np.frombuffer(d, dtype="<i8").copy() for d in obj["done"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(
                f"unreadable count-window checkpoint: {exc}", reason="bad_checkpoint"
            ) from exc
        if len(tail_rows) != len(self.windows) or len(done) != len(self.windows):
            raise SchemaError("count-window checkpoint of another spec", reason="bad_checkpoint")
        self._done = done
        for tails, rows in zip(self._tails, tail_rows, strict=True):
            tails.grow(len(self._keys))
            tails.add(rows.take(np.argsort(rows.key, kind="stable")))


def _distinct_batches(
    group: Int64Array, gateway: npt.NDArray[np.int32], seq: Int64Array, groups: int
) -> Int64Array:
    """Per window (dense, ascending ``group``), the distinct (gateway, seq) batches in it."""
    order = np.lexsort((seq, gateway, group))
    g, gw, s = group[order], gateway[order], seq[order]
    new = np.concatenate(([True], (g[1:] != g[:-1]) | (gw[1:] != gw[:-1]) | (s[1:] != s[:-1])))
    return np.bincount(g[new], minlength=groups).astype(np.int64)
