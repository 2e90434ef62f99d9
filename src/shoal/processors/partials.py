"""Phase one: a batch becomes per-(window, key) partial aggregates, routed to combiner partitions.

A worker turns every batch into exactly one ``Partial`` per combiner partition — even an empty
one — so that each partition sees every (gateway, seq) and can track contiguous progress. The
partial carries the batch's identity and event-time range besides the state rows.

Wire form (worker → combiner, ``shoal/partials/<pipeline>/<partition>``): a MsgPack map with
the batch header and the state frames as Arrow IPC streams (typed, columnar, zero-copy to read).

Count windows (``WindowSpec.by_count``) cannot be cut into per-batch state: which rows share a
window depends on the order of all of a key's rows, which no worker sees. For them a partial
carries the partition's *rows* instead (``EventRows``, the ``events`` section): key, event
time, row index within the batch and value, as narrow typed buffers; the combiner orders them
(``processors/count.py``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

import msgpack
import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import ConfigError, SchemaError
from shoal.processors._kernels import FieldKernels, GroupSorter, partial_state
from shoal.processors._panes import fan_out, fan_out_state
from shoal.processors.aggregates import LAST_TS, STATE_FIELDS
from shoal.processors.sessions import SESSION_KIND, SessionRule
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec
from shoal.processors.windows import WindowKind, WindowSpec, kind_of
from shoal.schemas import Batch, DictColumn

PARTIAL_VERSION: Final = 5
AGGS_GROUPS: Final[dict[str, pl.DataType]] = {
    "window": pl.UInt8(),
    "start": pl.Int64(),
    "key": pl.String(),
}
NULL_KEY_ID: Final = 0xFFFFFFFF
SKETCH_SCHEMA: Final = pl.Schema({"row": pl.UInt32(), "bucket": pl.Int32(), "count": pl.Int64()})
"""Sketch rows of a partial: ``row`` indexes the partial's state rows (no repeated keys)."""
Status = Literal["ok", "rejected"]
_ROUTE_CACHE_LIMIT: Final = 1_000_000


def spec_fingerprint(spec: PipelineSpec) -> str:
    """A short hash of everything that shapes partials; workers and combiners must agree."""
    text = repr(
        (
            spec.key,
            [_window_print(w) for w in spec.windows],
            spec.aggregate_names,
            spec.sketch_accuracy,
            spec.partitions,
            # The row stage shapes partials too; absent, fingerprints stay as they were.
            *((spec.where, spec.derive) if spec.row_rules is not None else ()),
            # So do user functions' code (absent: as before).
            *(
                (tuple((f.name, f.kind, f.entry, f.returns, f.code_hash) for f in spec.functions),)
                if spec.functions
                else ()
            ),
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _window_print(window: WindowSpec) -> tuple[object, ...]:
    """What of a window shapes partials.

    Tumbling and hopping windows print as before sessions and sliding windows existed; a
    sliding window is a hopping one plus its trigger, so its kind tells them apart.
    """
    aligned = (window.name, window.size_ms, window.slide_ms)
    if window.kind == "sliding":
        # "panes": partials carry state per pane, not per window (``pane_partials``).
        return (*aligned, window.kind, "panes")
    if window.by_count:
        return (*aligned, window.kind, window.count)
    if window.kind != SESSION_KIND:
        return aligned
    return (*aligned, window.kind, window.gap_ms, window.max_duration_ms)


def pane_partials(spec: PipelineSpec) -> list[bool]:
    """Per window of ``spec``, whether its partials carry state per *pane*, not per window.

    Sliding windows of more than one step, in specs without session windows (whose
    partials carry a per-row ``last`` that panes do not): a worker sends one state row per
    (pane of ``step_ms``, key) with ``start`` the pane's start, instead of ``size/step``
    window rows, and the combiner keeps panes and assembles each window from its panes when
    it closes (``state.WindowState``; docs/architecture.md "Panes in the combiner"). The
    fingerprint of a sliding window says so (``_window_print``): a worker and a combiner of
    different versions never mix the two forms.
    """
    if any(w.kind == SESSION_KIND for w in spec.windows):
        return [False] * len(spec.windows)
    return [w.kind == "sliding" and w.windows_per_row > 1 for w in spec.windows]


def expand_panes(
    rows: PartialRows, spec: PipelineSpec, fields: Sequence[FieldKernels]
) -> PartialRows:
    """The window rows a batch's pane rows stand for (``pane_partials``).

    Per window, the merge of the batch's panes it holds, ``batches`` 1, as a worker computes
    them for hopping windows (``_panes.fan_out_state``). ``rows``: pane rows of one batch,
    each (window, start, key) once.
    """
    parts: list[PartialRows] = []
    for index in np.unique(rows.window).tolist():
        window = spec.windows[index]
        fan, slide = window.windows_per_row, window.slide_ms
        mine = rows.take(np.flatnonzero(rows.window == index))
        key_ids = np.empty(len(mine), dtype=np.int64)
        names: dict[str | None, int] = {}
        for i, key in enumerate(mine.keys):
            key_ids[i] = names.setdefault(key, len(names))
        width = len(names)
        pane = mine.start // slide
        lowest = int(pane.min())
        g = (pane - lowest) * width + key_ids
        order = np.argsort(g, kind="stable")
        mine, g = mine.take(order), g[order]
        sketch = None
        if mine.sketch_row is not None:
            assert mine.sketch_bucket is not None
            assert mine.sketch_count is not None
            by_row = np.argsort(mine.sketch_row, kind="stable")
            sketch = (
                mine.sketch_row[by_row],
                mine.sketch_bucket[by_row],
                mine.sketch_count[by_row],
            )
        out_g, state, out_sketch = fan_out_state(g, dict(mine.fields), sketch, fan, width, fields)
        key_names = list(names)
        parts.append(
            PartialRows(
                window=np.full(len(out_g), index, dtype=np.uint8),
                start=(out_g // width + lowest - (fan - 1)) * slide,
                keys=[key_names[i] for i in (out_g % width).tolist()],
                fields=state,
                sketch_row=None if out_sketch is None else out_sketch[0],
                sketch_bucket=None if out_sketch is None else out_sketch[1],
                sketch_count=None if out_sketch is None else out_sketch[2],
            )
        )
    return concat_rows(parts)


def session_rule(window: WindowSpec) -> SessionRule | None:
    """The ``SessionRule`` of a session window; None for aligned kinds."""
    if window.kind != SESSION_KIND:
        return None
    if window.gap_ms is None:
        raise ConfigError(f"session window {window.name!r} has no gap_ms")
    return SessionRule(window.gap_ms, window.max_duration_ms)


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """The source batch a partial came from.

    Attributes:
        gateway_id: the gateway (from the ingest topic, checked against the envelope).
        seq: the batch's sequence number.
        stream: the stream of its ingest topic.
        rows: measurements in the whole batch (all partitions).
        min_ts: smallest event time in the batch (None: no rows).
        max_ts: largest event time in the batch (None: no rows).
        sent_at_ms: gateway clock when the batch was sealed.
        received_at_ms: worker clock when the batch arrived.
        worker: id of the worker that processed it.
        status: ``ok``, or ``rejected`` when it was dead-lettered (it still advances its
            gateway's sequence, with no rows).
        reason: the dead-letter reason, for rejected batches.
        filtered: rows of the batch the row stage removed (``where``, or a derived value
            that is null or not finite); included in ``rows``, in no state row.
    """

    gateway_id: str
    seq: int
    stream: str
    rows: int
    min_ts: int | None
    max_ts: int | None
    sent_at_ms: int
    received_at_ms: int
    worker: str
    status: Status = "ok"
    reason: str | None = None
    filtered: int = 0


_INT_FIELDS: Final = frozenset(f.name for f in STATE_FIELDS.values() if f.kind == "int")
"""State fields carried as integers (packed narrow on the wire); the others are float64."""


@dataclass(frozen=True, slots=True)
class PartialRows:
    """State rows of one partial, as columns.

    Attributes:
        window: index of the window spec per row.
        start: window start per row.
        keys: result key per row.
        fields: state field name → values per row (``aggregates.STATE_FIELDS`` dtypes).
        sketch_row: per sketch bucket, the state row it belongs to (None: no sketch).
        sketch_bucket: per sketch bucket, its key (``sketch.LogBuckets``).
        sketch_count: per sketch bucket, its count.
        last: only when the spec has a session window: per row, the largest event time of
            the rows in it (merged by max): a session piece's last timestamp (its ``start``
            is the first), the latest row of an aligned window's group. None otherwise.
    """

    window: npt.NDArray[np.uint8]
    start: npt.NDArray[np.int64]
    keys: list[str | None]
    fields: dict[str, npt.NDArray[Any]]
    sketch_row: npt.NDArray[np.int64] | None = None
    sketch_bucket: npt.NDArray[np.int64] | None = None
    sketch_count: npt.NDArray[np.int64] | None = None
    last: npt.NDArray[np.int64] | None = None

    def __len__(self) -> int:
        return len(self.start)

    def take(self, rows: npt.NDArray[np.int64]) -> PartialRows:
        """Only ``rows`` (sketch buckets follow their row and are renumbered)."""
        sketch_row = sketch_bucket = sketch_count = None
        if self.sketch_row is not None:
            renumber = np.full(len(self), -1, dtype=np.int64)
            renumber[rows] = np.arange(len(rows))
            kept = renumber[self.sketch_row]
            mask = kept >= 0
            sketch_row = kept[mask]
            sketch_bucket = None if self.sketch_bucket is None else self.sketch_bucket[mask]
            sketch_count = None if self.sketch_count is None else self.sketch_count[mask]
        return PartialRows(
            window=self.window[rows],
            start=self.start[rows],
            keys=[self.keys[i] for i in rows.tolist()],
            fields={name: values[rows] for name, values in self.fields.items()},
            sketch_row=sketch_row,
            sketch_bucket=sketch_bucket,
            sketch_count=sketch_count,
            last=None if self.last is None else self.last[rows],
        )

    def frame(self) -> pl.DataFrame:
        """The state rows as a DataFrame (``window``, ``start``, ``key``, [``last``], fields)."""
        last = [] if self.last is None else [pl.Series("last", self.last, dtype=pl.Int64)]
        return pl.DataFrame(
            [
                pl.Series("window", self.window, dtype=pl.UInt8),
                pl.Series("start", self.start, dtype=pl.Int64),
                pl.Series("key", self.keys, dtype=pl.String),
                *last,
                *(pl.Series(name, values) for name, values in self.fields.items()),
            ]
        )

    def sketch_frame(self) -> pl.DataFrame | None:
        """The sketch buckets as a DataFrame (``row``, ``bucket``, ``count``)."""
        if self.sketch_row is None:
            return None
        return pl.DataFrame(
            [
                pl.Series("row", self.sketch_row, dtype=pl.UInt32),
                pl.Series("bucket", self.sketch_bucket, dtype=pl.Int32),
                pl.Series("count", self.sketch_count, dtype=pl.Int64),
            ]
        )

    def pack(self) -> dict[str, Any]:
        """The wire form: typed little-endian buffers of the narrowest width, and the keys.

        Integer columns are sent as ``[dtype, bytes]`` with the smallest unsigned width that
        holds them (bucket keys as an offset from a base), which shrinks a partial of a
        16,000-row batch to about half.
        """
        out: dict[str, Any] = {
            "window": self.window.astype("<u1").tobytes(),
            "start": _pack_int(self.start),
            "keys": self.keys,
            "fields": {
                name: _pack_int(v)
                if name in _INT_FIELDS or v.dtype.kind in "iu"  # user aggregates' int fields
                else v.astype("<f8").tobytes()
                for name, v in self.fields.items()
            },
        }
        if self.last is not None:
            out["last"] = _pack_int(self.last)
        if self.sketch_row is not None:
            assert self.sketch_bucket is not None
            assert self.sketch_count is not None
            out["sketch"] = {
                "row": _pack_int(self.sketch_row),
                "bucket": _pack_int(self.sketch_bucket),
                "count": _pack_int(self.sketch_count),
            }
        return out

    @classmethod
    def unpack(cls, obj: dict[str, Any]) -> PartialRows:
        """Parse the wire form; raises ``SchemaError`` on inconsistent buffers."""
        keys = obj["keys"]
        if not isinstance(keys, list):
            raise SchemaError("keys is not a list", reason="bad_partial", field="keys")
        n = len(keys)
        sketch = obj.get("sketch")
        sketch_row = None if sketch is None else _unpack_int(sketch["row"], None)
        buckets = None if sketch_row is None else len(sketch_row)
        last = obj.get("last")
        return cls(
            window=_buffer(obj["window"], "<u1", n).astype(np.uint8),
            start=_unpack_int(obj["start"], n),
            keys=keys,
            fields={
                # int fields are packed as [base, dtype, bytes], float ones as bytes
                name: _unpack_int(data, n)
                if name in _INT_FIELDS or isinstance(data, list)
                else _buffer(data, "<f8", n)
                for name, data in obj["fields"].items()
            },
            sketch_row=sketch_row,
            sketch_bucket=None if sketch is None else _unpack_int(sketch["bucket"], buckets),
            sketch_count=None if sketch is None else _unpack_int(sketch["count"], buckets),
            last=None if last is None else _unpack_int(last, n),
        )


def pack_with_key_ids(rows: PartialRows, key_ids: npt.NDArray[np.int64]) -> dict[str, Any]:
    """``rows.pack()`` with each row's key as an id into a key table kept beside it.

    For checkpoints of large states: packing a million key names each time cost more than the
    rest (``WindowState.snapshot_panes``). ``unpack_with_key_names`` reads it back.
    """
    packed = replace(rows, keys=[]).pack()
    packed["keys"] = _pack_int(key_ids)
    return packed


def unpack_with_key_names(obj: dict[str, Any], names: Sequence[str | None]) -> PartialRows:
    """Read ``pack_with_key_ids``'s form back, each key id replaced by its name in ``names``.

    Raises:
        SchemaError: inconsistent buffers, or a key id outside ``names``.
    """
    ids = _unpack_int(obj["keys"], None)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(names)):
        raise SchemaError("key id out of range", reason="bad_partial", field="keys")
    return PartialRows.unpack({**obj, "keys": [names[i] for i in ids.tolist()]})


_WIDTHS: Final = (("u1", 0xFF), ("u2", 0xFFFF), ("u4", 0xFFFFFFFF))


def _pack_int(values: npt.NDArray[Any]) -> list[Any]:
    """``[base, dtype, bytes]``: values minus ``base`` in the narrowest unsigned width."""
    if len(values) == 0:
        return [0, "u1", b""]
    # The ufuncs' own reductions: ``values.min()`` goes through two Python-level wrappers,
    # ~1 us of each of the ~8 columns a partial packs.
    base = int(np.minimum.reduce(values))
    span = int(np.maximum.reduce(values)) - base
    for name, top in _WIDTHS:
        if span <= top:
            return [base, name, (values - base).astype(f"<{name}").tobytes()]
    return [0, "i8", values.astype("<i8").tobytes()]


def _buffer(data: bytes, dtype: str | np.dtype[Any], n: int | None) -> npt.NDArray[Any]:
    array = np.frombuffer(data, dtype=dtype)
    if n is not None and len(array) != n:
        raise SchemaError(
            "inconsistent state buffer",
            reason="bad_partial",
            expected=f"{n} values",
            found=f"{len(array)}",
        )
    return array


def _unpack_int(packed: list[Any], n: int | None) -> npt.NDArray[np.int64]:
    base, dtype, data = packed
    if dtype not in ("u1", "u2", "u4", "i8") or type(base) is not int:
        raise SchemaError(
            "bad integer buffer",
            reason="bad_partial",
            expected="an int base and dtype u1, u2, u4 or i8",
            found=f"{type(base).__name__} base, dtype {dtype!r}",
        )
    values = _buffer(data, f"<{dtype}", n)
    if base == 0:
        return values.astype(np.int64)
    # one pass into a new int64 array (astype, then ``+ base``, made two, and a temporary)
    widened: npt.NDArray[np.int64] = np.add(values, base, dtype=np.int64)
    return widened


@dataclass(frozen=True, slots=True)
class EventRows:
    """One partition's rows of one batch, for count windows (no state: the rows themselves).

    Attributes:
        keys: the distinct result keys of these rows.
        key: per row, its key's index in ``keys``.
        ts: per row, its event time.
        row: per row, its index within the whole decoded batch (the last of ``COUNT_ORDER``).
        value: per row, its value (read-only once unpacked: a view of the message's bytes).
    """

    keys: list[str | None]
    key: npt.NDArray[np.int64]
    ts: npt.NDArray[np.int64]
    row: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]

    def __len__(self) -> int:
        return len(self.ts)

    @classmethod
    def split(
        cls,
        key_ids: npt.NDArray[np.int64],
        key_names: list[str | None],
        ts: npt.NDArray[np.int64],
        value: npt.NDArray[np.float64],
        router: KeyRouter,
    ) -> dict[int, EventRows]:
        """A batch's rows by partition (``key_ids`` index ``key_names``); rows keep their order."""
        row = np.arange(len(ts), dtype=np.int64)
        if router.partitions == 1:
            return {0: cls(key_names, key_ids, ts, row, value)}
        part_of_key = np.array([router.partition_of(k) for k in key_names], dtype=np.int64)
        part = part_of_key[key_ids]
        out: dict[int, EventRows] = {}
        for p in np.unique(part).tolist():
            picked = np.flatnonzero(part == p)
            used, local = np.unique(key_ids[picked], return_inverse=True)
            out[p] = cls(
                [key_names[k] for k in used.tolist()],
                local.reshape(-1).astype(np.int64),
                ts[picked],
                picked,
                value[picked],
            )
        return out

    def pack(self) -> dict[str, Any]:
        """The wire form: integer columns packed narrow (``_pack_int``), values as f8."""
        return {
            "keys": self.keys,
            "key": _pack_int(self.key),
            "ts": _pack_int(self.ts),
            "row": _pack_int(self.row),
            "value": self.value.astype("<f8").tobytes(),
        }

    @classmethod
    def unpack(cls, obj: dict[str, Any]) -> EventRows:
        """Parse the wire form; raises ``SchemaError`` on inconsistent buffers."""
        keys = obj["keys"]
        if not isinstance(keys, list):
            raise SchemaError("keys is not a list", reason="bad_partial", field="events.keys")
        ts = _unpack_int(obj["ts"], None)
        key = _unpack_int(obj["key"], len(ts))
        if len(key) and (int(key.min()) < 0 or int(key.max()) >= len(keys)):
            raise SchemaError(
                "event key index out of range", reason="bad_partial", field="events.key"
            )
        return cls(
            keys=keys,
            key=key,
            ts=ts,
            row=_unpack_int(obj["row"], len(ts)),
            value=_buffer(obj["value"], "<f8", len(ts)),  # read-only, over the payload's bytes
        )


@dataclass(frozen=True, slots=True)
class Partial:
    """What one combiner partition receives for one batch.

    Attributes:
        pipeline: pipeline name.
        fingerprint: ``spec_fingerprint`` of the worker's spec.
        partition: the receiving partition.
        partitions: number of partitions.
        batch: the source batch.
        rows: the partition's state rows (None: no rows for this partition).
        produced_at_ms: worker clock when the partial was computed.
        events: the partition's rows for count windows (None: none, or time windows).
    """

    pipeline: str
    fingerprint: str
    partition: int
    partitions: int
    batch: BatchInfo
    rows: PartialRows | None
    produced_at_ms: int
    events: EventRows | None = None

    @property
    def aggs(self) -> pl.DataFrame | None:
        """The state rows as a DataFrame (for inspection and tests)."""
        return None if self.rows is None else self.rows.frame()

    @property
    def sketch(self) -> pl.DataFrame | None:
        """The sketch buckets as a DataFrame (``row`` points into ``aggs``)."""
        return None if self.rows is None else self.rows.sketch_frame()

    def encode(self) -> bytes:
        """Serialise for the partials topic."""
        b = self.batch
        packed = msgpack.packb(
            {
                "v": PARTIAL_VERSION,
                "pipeline": self.pipeline,
                "fp": self.fingerprint,
                "partition": self.partition,
                "partitions": self.partitions,
                "gateway_id": b.gateway_id,
                "seq": b.seq,
                "stream": b.stream,
                "rows": b.rows,
                "min_ts": b.min_ts,
                "max_ts": b.max_ts,
                "sent_at": b.sent_at_ms,
                "received_at": b.received_at_ms,
                "worker": b.worker,
                "status": b.status,
                "reason": b.reason,
                **({"filtered": b.filtered} if b.filtered else {}),
                "state": None if self.rows is None else self.rows.pack(),
                "produced_at": self.produced_at_ms,
                **({} if self.events is None else {"events": self.events.pack()}),
            },
            use_bin_type=True,
        )
        assert isinstance(packed, bytes)
        return packed

    @classmethod
    def decode(cls, payload: bytes) -> Partial:
        """Parse a partials message; raises ``SchemaError`` on anything malformed."""
        try:
            return cls._from_obj(msgpack.unpackb(payload, raw=False))
        except Exception as exc:
            raise SchemaError(f"malformed partials message: {exc}", reason="bad_partial") from exc

    @classmethod
    def _from_obj(cls, obj: dict[str, Any]) -> Partial:
        if obj["v"] != PARTIAL_VERSION:
            raise SchemaError(
                "partials message of another version",
                reason="bad_partial",
                field="v",
                expected=str(PARTIAL_VERSION),
                found=repr(obj["v"]),
            )
        batch = BatchInfo(
            gateway_id=obj["gateway_id"],
            seq=int(obj["seq"]),
            stream=obj["stream"],
            rows=int(obj["rows"]),
            min_ts=obj["min_ts"],
            max_ts=obj["max_ts"],
            sent_at_ms=int(obj["sent_at"]),
            received_at_ms=int(obj["received_at"]),
            worker=obj["worker"],
            status=obj["status"],
            reason=obj["reason"],
            filtered=int(obj.get("filtered", 0)),
        )
        state = obj["state"]
        return cls(
            pipeline=obj["pipeline"],
            fingerprint=obj["fp"],
            partition=int(obj["partition"]),
            partitions=int(obj["partitions"]),
            batch=batch,
            rows=None if state is None else PartialRows.unpack(state),
            produced_at_ms=int(obj["produced_at"]),
            events=None if obj.get("events") is None else EventRows.unpack(obj["events"]),
        )


class KeyRouter:
    """Stable key → partition routing (CRC-32 of the UTF-8 key, modulo partitions).

    Independent of process, platform and library versions, so every worker agrees.
    """

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self._cache: dict[str, int] = {}

    def partition_of(self, key: str | None) -> int:
        """The partition of one key."""
        if self.partitions == 1:
            return 0
        text = "" if key is None else key
        part = self._cache.get(text)
        if part is None:
            part = zlib.crc32(text.encode()) % self.partitions
            if len(self._cache) < _ROUTE_CACHE_LIMIT:
                self._cache[text] = part
        return part

    def route(self, keys: pl.Series) -> pl.Series:
        """Partition of each key, as a UInt16 series aligned with ``keys``."""
        if self.partitions == 1:
            return pl.Series("partition", np.zeros(keys.len(), dtype=np.uint16))
        uniques = keys.unique()
        parts = [self.partition_of(k) for k in uniques.to_list()]
        mapping = pl.DataFrame({"key": uniques, "partition": pl.Series(parts, dtype=pl.UInt16)})
        return keys.to_frame("key").join(mapping, on="key", how="left", nulls_equal=True)[
            "partition"
        ]


class PartialBuilder:
    """Compiles a pipeline spec once and turns decoded batches into partials.

    A spec's row stage (``where``/``derive``, ``shoal.rules``) runs first, on the decoded frame.

    Each window's kind (``windows.WINDOW_KINDS``) assigns the rows to windows; the state of
    all (window, start, key) groups of a batch then comes from one sort and the ``reduceat``
    kernels of the plan's state fields (``_kernels.partial_state``, ``aggregates.py``). A
    session window's rows are labelled per key by ``SessionRule.label_rows`` instead: one
    state row per *piece* (the batch's rows of one key in one session), with its first
    timestamp as ``start`` and its last as ``last``.
    """

    def __init__(self, spec: PipelineSpec, worker_id: str) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.plan = spec.plan()
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self.router = KeyRouter(spec.partitions)
        self.fingerprint = spec_fingerprint(spec)
        self._rules = [session_rule(w) for w in spec.windows]
        self._kinds: list[WindowKind | None] = [
            None if rule is not None else kind_of(w)
            for w, rule in zip(spec.windows, self._rules, strict=True)
        ]
        self._has_sessions = any(rule is not None for rule in self._rules)
        self._panes = pane_partials(spec)
        # With sessions, aligned groups carry ``last`` too: the LAST_TS kernel computes it
        # with the state (merged per pane like any field), dropped from the fields unless
        # the plan has it.
        self._last_is_field = LAST_TS.name in self.plan.field_names
        self._aligned_fields = (
            (*self.plan.fields, LAST_TS)
            if self._has_sessions and not self._last_is_field
            else self.plan.fields
        )
        self._schema = self.plan.state_schema(AGGS_GROUPS)
        self._by_count = any(w.by_count for w in spec.windows)
        # Per window: batches of one gateway often repeat their keys' order (``GroupSorter``).
        self._sorters = [GroupSorter() for _ in spec.windows]
        self.rules = spec.row_rules

    def build(
        self,
        frame: pl.DataFrame,
        batch: BatchInfo,
        now_ms: int,
        codes: dict[str, DictColumn] | None = None,
    ) -> list[Partial]:
        """One partial per partition for a decoded batch (``FRAME_SCHEMA`` frame).

        ``codes`` are the batch's dictionary-coded columns (``Batch.codes``), if any: keys
        that arrived coded are grouped on their codes directly.
        """
        if self.rules is not None:
            frame, batch, codes = self._row_stage(frame, batch, codes)
        coded = None if codes is None else codes.get(self.spec.key)
        return self._build(
            frame.get_column("ts").to_numpy(),
            frame.get_column("value").to_numpy(),
            coded,
            None if coded is not None else frame.get_column(self.spec.key),
            batch,
            now_ms,
        )

    def build_batch(self, decoded: Batch, batch: BatchInfo, now_ms: int) -> list[Partial]:
        """``build`` for a decoded batch, from its arrays and codes.

        Its frame is not built when the key column arrived dictionary-coded (binary columnar:
        the worker's fast path).
        """
        if self.rules is not None:
            key = self.spec.key
            by_code = key in decoded.codes and not self.rules.derives(key)
            wanted = {*self.rules.inputs, "ts", "value", *(() if by_code else (key,))}
            return self.build(decoded.columns(wanted), batch, now_ms, decoded.codes)
        coded = decoded.codes.get(self.spec.key)
        keys = None if coded is not None else decoded.frame.get_column(self.spec.key)
        return self._build(decoded.ts, decoded.value, coded, keys, batch, now_ms)

    def _row_stage(
        self, frame: pl.DataFrame, batch: BatchInfo, codes: dict[str, DictColumn] | None
    ) -> tuple[pl.DataFrame, BatchInfo, dict[str, DictColumn] | None]:
        """``derive`` then ``where`` (``shoal.rules``): kept rows, batch info, key codes.

        The info gets ``filtered`` and its event-time range over every row, kept or not: a
        gateway whose rows all fail ``where`` still moves its watermark on. A key that arrived
        dictionary-coded stays coded (its codes filtered alike) unless ``derive`` replaced it:
        grouping on codes is the worker's fast path.
        """
        assert self.rules is not None
        key = self.spec.key
        kept = self.rules.apply(frame, ("ts", "value", key))
        ts = frame.get_column("ts")
        batch = replace(
            batch,
            filtered=kept.filtered + kept.invalid,
            min_ts=None if ts.is_empty() else int(ts.min()),  # type: ignore[arg-type]
            max_ts=None if ts.is_empty() else int(ts.max()),  # type: ignore[arg-type]
        )
        coded = None if codes is None or self.rules.derives(key) else codes.get(key)
        if coded is not None and kept.mask is not None:
            coded = DictColumn(coded.values, coded.codes[kept.mask.to_numpy()])
        return kept.frame, batch, None if coded is None else {key: coded}

    def _build(  # noqa: PLR0917 - private; the two public entry points name everything
        self,
        ts: npt.NDArray[np.int64],
        value: npt.NDArray[np.float64],
        coded: DictColumn | None,
        keys: pl.Series | None,
        batch: BatchInfo,
        now_ms: int,
    ) -> list[Partial]:
        if len(ts) == 0:
            return self._split(replace(batch, rows=batch.filtered), None, now_ms)
        # ``rows`` counts the whole batch, the rows the row stage removed included; so does
        # the event-time range when the worker set it (the watermark follows every row).
        batch = replace(
            batch,
            rows=len(ts) + batch.filtered,
            min_ts=int(ts.min()) if batch.min_ts is None else batch.min_ts,
            max_ts=int(ts.max()) if batch.max_ts is None else batch.max_ts,
        )
        key_names: list[str | None]
        if coded is not None:
            key_ids = coded.codes.astype(np.int64)
            key_names = list(coded.values)
        else:
            assert keys is not None
            # Dense key ids without a Python loop: polars' categorical codes, then their rank.
            # Rows without a key (an attribute key may be null) share one id.
            physical = (
                keys.cast(pl.Categorical)
                .to_physical()
                .fill_null(NULL_KEY_ID)
                .to_numpy()
                .astype(np.int64)
            )
            _, first_row, key_ids = np.unique(physical, return_index=True, return_inverse=True)
            key_ids = key_ids.reshape(-1).astype(np.int64)
            key_names = keys.gather(pl.Series(first_row, dtype=pl.UInt32)).to_list()
        if self._by_count:  # count windows: the rows themselves (see the module docstring)
            events = EventRows.split(key_ids, key_names, ts, value, self.router)
            return self._split(batch, None, now_ms, events)
        width = len(key_names)
        bucket_all = self.buckets.keys_np(value) if self.plan.needs_sketch else None
        fields = self.plan.fields
        parts: list[PartialRows] = []
        for index, (window, kind) in enumerate(zip(self.spec.windows, self._kinds, strict=True)):
            rule = self._rules[index]
            if rule is not None:
                s = rule.label_rows(key_ids, ts)
                g, state, sketch = partial_state(s.label, ts, value, fields, bucket_all)
                parts.append(
                    PartialRows(
                        window=np.full(len(g), index, dtype=np.uint8),
                        start=s.first_ts[g],
                        keys=[key_names[i] for i in s.key[g].tolist()],
                        fields=state,
                        sketch_row=None if sketch is None else sketch[0],
                        sketch_bucket=None if sketch is None else sketch[1],
                        sketch_count=None if sketch is None else sketch[2],
                        last=s.last_ts[g],
                    )
                )
                continue
            assert kind is not None
            assigned = kind.assign(ts, window)
            per_row = assigned.per_row
            if per_row == 1:
                rows_ts, rows_value, rows_key, rows_bucket = ts, value, key_ids, bucket_all
            else:
                rows_ts, rows_value = np.repeat(ts, per_row), np.repeat(value, per_row)
                rows_key = np.repeat(key_ids, per_row)
                rows_bucket = None if bucket_all is None else np.repeat(bucket_all, per_row)
            pane_start = 0  # pane partials: a pane's start is its newest window's
            if self._panes[index]:
                pane_start = (assigned.fan - 1) * assigned.step
            if assigned.fan > 1 and not self._panes[index]:
                # hopping: state per pane, then per window (``_panes``)
                g, state, sketch = fan_out(
                    assigned.slot,
                    assigned.fan,
                    rows_key,
                    width,
                    rows_ts,
                    rows_value,
                    self._aligned_fields,
                    rows_bucket,
                )
            else:
                # Dense group ids (slot-major): small enough for a radix sort in the kernel.
                groups = assigned.slot * width + rows_key
                g, state, sketch = partial_state(
                    groups,
                    rows_ts,
                    rows_value,
                    self._aligned_fields,
                    rows_bucket,
                    sorter=self._sorters[index],
                )
            last = None
            if self._has_sessions:  # 'last': the largest event time of each group's rows
                last = state[LAST_TS.name] if self._last_is_field else state.pop(LAST_TS.name)
            parts.append(
                PartialRows(
                    window=np.full(len(g), index, dtype=np.uint8),
                    start=assigned.starts(g // width) + pane_start,
                    keys=_names_of(key_names, g),
                    fields=state,
                    sketch_row=None if sketch is None else sketch[0],
                    sketch_bucket=None if sketch is None else sketch[1],
                    sketch_count=None if sketch is None else sketch[2],
                    last=last,
                )
            )
        return self._split(batch, concat_rows(parts), now_ms)

    def rejected(self, batch: BatchInfo, now_ms: int) -> list[Partial]:
        """Empty partials marking a dead-lettered batch as handled (it still advances seq)."""
        return self._split(batch, None, now_ms)

    def _split(
        self,
        batch: BatchInfo,
        rows: PartialRows | None,
        now_ms: int,
        events: dict[int, EventRows] | None = None,
    ) -> list[Partial]:
        partitions = self.spec.partitions
        by_part: dict[int, PartialRows] = {}
        if rows is not None and partitions == 1:
            by_part[0] = rows
        elif rows is not None:
            part = np.array([self.router.partition_of(k) for k in rows.keys], dtype=np.int64)
            by_part = {int(p): rows.take(np.flatnonzero(part == p)) for p in np.unique(part)}
        return [
            Partial(
                pipeline=self.spec.name,
                fingerprint=self.fingerprint,
                partition=p,
                partitions=partitions,
                batch=batch,
                rows=by_part.get(p),
                produced_at_ms=now_ms,
                events=None if events is None else events.get(p),
            )
            for p in range(partitions)
        ]


def _names_of(names: list[str | None], groups: npt.NDArray[np.int64]) -> list[str | None]:
    """The key name of each group (``slot * len(names) + key``, ascending and unique).

    The usual batch has every key once in one slot: its groups are one range of
    ``len(names)`` ids starting at a multiple of it, told by its ends alone, and the names
    are the list itself.
    """
    width = len(names)
    if len(groups) == width and (
        width == 0 or (int(groups[-1]) - int(groups[0]) == width - 1 and groups[0] % width == 0)
    ):
        return list(names)
    return [names[i] for i in (groups % width).tolist()]


def concat_rows(parts: list[PartialRows]) -> PartialRows:
    """One ``PartialRows`` from several (sketch rows renumbered)."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0, *(len(p) for p in parts[:-1])])
    with_sketch = parts[0].sketch_row is not None
    return PartialRows(
        window=np.concatenate([p.window for p in parts]),
        start=np.concatenate([p.start for p in parts]),
        keys=[k for p in parts for k in p.keys],
        fields={name: np.concatenate([p.fields[name] for p in parts]) for name in parts[0].fields},
        sketch_row=np.concatenate(
            [
                p.sketch_row + off
                for p, off in zip(parts, offsets, strict=True)
                if p.sketch_row is not None
            ]
        )
        if with_sketch
        else None,
        sketch_bucket=np.concatenate(
            [p.sketch_bucket for p in parts if p.sketch_bucket is not None]
        )
        if with_sketch
        else None,
        sketch_count=np.concatenate([p.sketch_count for p in parts if p.sketch_count is not None])
        if with_sketch
        else None,
        last=np.concatenate([p.last for p in parts if p.last is not None])
        if parts[0].last is not None
        else None,
    )
