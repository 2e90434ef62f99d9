"""Phase one: a batch becomes per-(window, key) partial aggregates, routed to combiner partitions.

A worker turns every batch into exactly one ``Partial`` per combiner partition — even an empty
one — so that each partition sees every (gateway, seq) and can track contiguous progress. The
partial carries the batch's identity and event-time range besides the state rows.

Wire form (worker → combiner, ``shoal/partials/<pipeline>/<partition>``): a MsgPack map with
the batch header and the state frames as Arrow IPC streams (typed, columnar, zero-copy to read).
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

import msgpack
import numpy as np
import polars as pl

from shoal.errors import SchemaError
from shoal.processors._ipc import from_ipc, to_ipc
from shoal.processors._kernels import partial_state
from shoal.processors.aggregates import AggregatePlan
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec

PARTIAL_VERSION: Final = 2
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
            [(w.name, w.size_ms, w.slide_ms) for w in spec.windows],
            spec.aggregate_names,
            spec.sketch_accuracy,
            spec.partitions,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


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


@dataclass(frozen=True, slots=True)
class Partial:
    """What one combiner partition receives for one batch.

    Attributes:
        pipeline: pipeline name.
        fingerprint: ``spec_fingerprint`` of the worker's spec.
        partition: the receiving partition.
        partitions: number of partitions.
        batch: the source batch.
        aggs: state rows (``window`` index, ``start``, ``key``, state fields) or None.
        sketch: bucket counts (``row`` of ``aggs``, ``bucket`` key, ``count``) or None.
        produced_at_ms: worker clock when published.
    """

    pipeline: str
    fingerprint: str
    partition: int
    partitions: int
    batch: BatchInfo
    aggs: pl.DataFrame | None
    sketch: pl.DataFrame | None
    produced_at_ms: int

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
                "aggs": to_ipc(self.aggs),
                "sketch": to_ipc(self.sketch),
                "produced_at": self.produced_at_ms,
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
            raise ValueError(f"partials version {obj['v']!r}, expected {PARTIAL_VERSION}")
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
        )
        return cls(
            pipeline=obj["pipeline"],
            fingerprint=obj["fp"],
            partition=int(obj["partition"]),
            partitions=int(obj["partitions"]),
            batch=batch,
            aggs=from_ipc(obj["aggs"]),
            sketch=from_ipc(obj["sketch"]),
            produced_at_ms=int(obj["produced_at"]),
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

    The state of all (window, start, key) groups of a batch comes from one sort and
    ``reduceat`` passes (``_kernels.partial_state``), the numpy twin of the polars
    expressions in ``aggregates.py``.
    """

    def __init__(self, spec: PipelineSpec, worker_id: str) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.plan = AggregatePlan.for_spec(spec)
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self.router = KeyRouter(spec.partitions)
        self.fingerprint = spec_fingerprint(spec)
        self._fields = self.plan.field_names
        self._schema = self.plan.state_schema(AGGS_GROUPS)

    def build(self, frame: pl.DataFrame, batch: BatchInfo, now_ms: int) -> list[Partial]:
        """One partial per partition for a decoded batch (``FRAME_SCHEMA`` frame)."""
        if frame.height == 0:
            return self._split(replace(batch, rows=0), None, None, now_ms)
        keys = frame.get_column(self.spec.key)
        ts = frame.get_column("ts").to_numpy()
        value = frame.get_column("value").to_numpy()
        batch = replace(batch, rows=frame.height, min_ts=int(ts.min()), max_ts=int(ts.max()))
        # Key ids: polars' categorical codes are exact and cheap (no Python per row); rows
        # without a key (an attribute key may be null) share the largest id.
        key_ids = (
            keys.cast(pl.Categorical)
            .to_physical()
            .fill_null(NULL_KEY_ID)
            .to_numpy()
            .astype(np.int64)
        )
        unique_ids, first_row = np.unique(key_ids, return_index=True)
        bucket_all = self.buckets.keys_np(value) if self.plan.needs_sketch else None
        aggs_parts: list[pl.DataFrame] = []
        sketch_parts: list[pl.DataFrame] = []
        offset = 0
        for index, window in enumerate(self.spec.windows):
            per_row = window.windows_per_row
            last = (ts // window.slide_ms) * window.slide_ms
            if per_row == 1:
                starts, rows_ts, rows_value, rows_key = last, ts, value, key_ids
                rows_bucket = bucket_all
            else:
                hop = np.arange(per_row, dtype=np.int64) * window.slide_ms
                starts = (last[:, None] - hop[None, :]).ravel()
                rows_ts, rows_value = np.repeat(ts, per_row), np.repeat(value, per_row)
                rows_key = np.repeat(key_ids, per_row)
                rows_bucket = None if bucket_all is None else np.repeat(bucket_all, per_row)
            base = int(starts.min())
            slot = (starts - base) // window.slide_ms
            groups = (slot << 32) | rows_key
            g, state, sketch = partial_state(groups, rows_ts, rows_value, self._fields, rows_bucket)
            key_rows = first_row[np.searchsorted(unique_ids, g & 0xFFFFFFFF)]
            columns: dict[str, object] = {
                "window": np.full(len(g), index, dtype=np.uint8),
                "start": (g >> 32) * window.slide_ms + base,
                "key": keys.gather(pl.Series(key_rows, dtype=pl.UInt32)),
                **state,
            }
            aggs_parts.append(pl.DataFrame(columns, schema=self._schema))
            if sketch is not None:
                group_index, bucket, count = sketch
                sketch_parts.append(
                    pl.DataFrame(
                        {"row": group_index + offset, "bucket": bucket, "count": count},
                        schema=SKETCH_SCHEMA,
                    )
                )
            offset += len(g)
        aggs = pl.concat(aggs_parts) if len(aggs_parts) > 1 else aggs_parts[0]
        sketch_frame = (
            None
            if not sketch_parts
            else pl.concat(sketch_parts)
            if len(sketch_parts) > 1
            else sketch_parts[0]
        )
        return self._split(batch, aggs, sketch_frame, now_ms)

    def rejected(self, batch: BatchInfo, now_ms: int) -> list[Partial]:
        """Empty partials marking a dead-lettered batch as handled (it still advances seq)."""
        return self._split(batch, None, None, now_ms)

    def _split(
        self,
        batch: BatchInfo,
        aggs: pl.DataFrame | None,
        sketch: pl.DataFrame | None,
        now_ms: int,
    ) -> list[Partial]:
        partitions = self.spec.partitions
        by_part: dict[int, tuple[pl.DataFrame | None, pl.DataFrame | None]] = {}
        if aggs is not None and partitions == 1:
            by_part[0] = (aggs, sketch)
        elif aggs is not None:
            by_part = split_by_partition(aggs, sketch, self.router)
        return [
            Partial(
                pipeline=self.spec.name,
                fingerprint=self.fingerprint,
                partition=p,
                partitions=partitions,
                batch=batch,
                aggs=by_part.get(p, (None, None))[0],
                sketch=by_part.get(p, (None, None))[1],
                produced_at_ms=now_ms,
            )
            for p in range(partitions)
        ]


def split_by_partition(
    aggs: pl.DataFrame, sketch: pl.DataFrame | None, router: KeyRouter
) -> dict[int, tuple[pl.DataFrame | None, pl.DataFrame | None]]:
    """Split state rows by the partition of their key; sketch rows follow their state row."""
    part = router.route(aggs.get_column("key")).to_numpy()
    out: dict[int, tuple[pl.DataFrame | None, pl.DataFrame | None]] = {}
    # The new row number of every state row inside its partition's frame.
    renumber = np.zeros(len(part), dtype=np.int64)
    for p in np.unique(part).tolist():
        rows = np.flatnonzero(part == p)
        renumber[rows] = np.arange(len(rows))
        sub_sketch = None
        if sketch is not None:
            sketch_rows = sketch.get_column("row").to_numpy()
            keep = np.flatnonzero(part[sketch_rows] == p)
            sub_sketch = sketch[keep].with_columns(
                pl.Series("row", renumber[sketch_rows[keep]], dtype=pl.UInt32)
            )
        out[int(p)] = (aggs[rows], sub_sketch)
    return out
