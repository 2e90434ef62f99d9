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
from shoal.processors.aggregates import AggregatePlan
from shoal.processors.sketch import LogBuckets
from shoal.processors.spec import PipelineSpec
from shoal.processors.windows import with_window_starts

PARTIAL_VERSION: Final = 1
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
        sketch: bucket counts (``window``, ``start``, ``key``, ``bucket``, ``count``) or None.
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
    """Compiles a pipeline spec once and turns decoded batches into partials."""

    def __init__(self, spec: PipelineSpec, worker_id: str) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.plan = AggregatePlan.for_spec(spec)
        self.buckets = LogBuckets(spec.sketch_accuracy)
        self.router = KeyRouter(spec.partitions)
        self.fingerprint = spec_fingerprint(spec)
        self._partial_exprs = self.plan.partial_exprs()

    def build(self, frame: pl.DataFrame, batch: BatchInfo, now_ms: int) -> list[Partial]:
        """One partial per partition for a decoded batch (``FRAME_SCHEMA`` frame)."""
        rows = frame.select(pl.col(self.spec.key).alias("key"), pl.col("ts"), pl.col("value"))
        if rows.height:
            batch = replace(
                batch,
                rows=rows.height,
                min_ts=int(rows["ts"].min()),  # type: ignore[arg-type]
                max_ts=int(rows["ts"].max()),  # type: ignore[arg-type]
            )
        aggs_parts, sketch_parts = [], []
        for index, window in enumerate(self.spec.windows):
            windowed = with_window_starts(rows, window)
            aggs_parts.append(
                windowed.group_by("start", "key")
                .agg(self._partial_exprs)
                .select(pl.lit(index, dtype=pl.UInt8).alias("window"), pl.all())
            )
            if self.plan.needs_sketch:
                sketch_parts.append(
                    windowed.group_by(
                        "start", "key", self.buckets.key_expr(pl.col("value")).alias("bucket")
                    )
                    .agg(count=pl.len().cast(pl.Int64))
                    .select(pl.lit(index, dtype=pl.UInt8).alias("window"), pl.all())
                )
        aggs = pl.concat(aggs_parts) if rows.height else None
        sketch = pl.concat(sketch_parts) if sketch_parts and rows.height else None
        return self._split(batch, aggs, sketch, now_ms)

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
        by_part_aggs: dict[int, pl.DataFrame] = {}
        by_part_sketch: dict[int, pl.DataFrame] = {}
        if partitions == 1:
            if aggs is not None:
                by_part_aggs[0] = aggs
            if sketch is not None:
                by_part_sketch[0] = sketch
        else:
            if aggs is not None:
                by_part_aggs = _split_frame(aggs, self.router)
            if sketch is not None:
                by_part_sketch = _split_frame(sketch, self.router)
        return [
            Partial(
                pipeline=self.spec.name,
                fingerprint=self.fingerprint,
                partition=p,
                partitions=partitions,
                batch=batch,
                aggs=by_part_aggs.get(p),
                sketch=by_part_sketch.get(p),
                produced_at_ms=now_ms,
            )
            for p in range(partitions)
        ]


def _split_frame(frame: pl.DataFrame, router: KeyRouter) -> dict[int, pl.DataFrame]:
    routed = frame.with_columns(router.route(frame["key"]).alias("_partition"))
    return {
        int(part[0]): chunk.drop("_partition")
        for part, chunk in routed.partition_by("_partition", as_dict=True).items()
    }
