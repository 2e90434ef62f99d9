"""Control messages of the wire contract: confirmations and gateway status (JSON).

Both are small JSON objects so any gateway implementation (C, Go, JavaScript) can read and
write them; see ``schemas/CONTRACT.md``.

- ``Confirm`` (combiner → gateway, retained, ``shoal/confirm/<gateway>/<pipeline>/<partition>``):
  every batch of the gateway with ``seq <= confirm.seq`` is fully applied by that partition of
  that pipeline and durable there. A batch is confirmed for a pipeline once all of its
  partitions confirm it.
- ``GatewayStatus`` (gateway → everyone, retained, ``shoal/gateway/<gateway>``): what the
  gateway has published and what is still unconfirmed; the lag monitor and combiners read it.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any, Final, Self

import orjson

from shoal.errors import SchemaError
from shoal.schemas._checks import GATEWAY_ID_PATTERN, describe, require_int, require_map
from shoal.schemas._model import MAX_SEQ, MAX_TS_MS, SCHEMA_VERSION


def _load(payload: bytes, what: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"invalid JSON in {what}: {exc}", reason="bad_json") from exc
    obj = require_map(obj, what)
    version = obj.get("shoal")
    if type(version) is not int or version != SCHEMA_VERSION:  # true == 1 in Python
        raise SchemaError(
            f"unsupported {what} version",
            reason="unsupported_version",
            field="shoal",
            expected=str(SCHEMA_VERSION),
            found=describe(version),
        )
    return obj


def _name(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or GATEWAY_ID_PATTERN.fullmatch(value) is None:
        raise SchemaError(
            "invalid name",
            reason="bad_name",
            field=key,
            expected="a topic-safe name",
            found=describe(value),
        )
    return value


@dataclass(frozen=True, slots=True)
class Confirm:
    """Progress of one combiner partition of one pipeline for one gateway.

    Attributes:
        gateway_id: whose batches.
        pipeline: which pipeline confirms.
        partition: which combiner partition.
        partitions: how many partitions the pipeline has (all must confirm).
        seq: every batch with a seq up to this one is applied and durable.
        at_ms: combiner clock when sent.
        missing: seqs above ``seq`` the partition has been waiting for (at least one
            confirmation interval) while it holds later batches of the gateway: most likely
            lost on the way (a broker queue overflowed, a worker died with them), so the
            gateway re-sends them without waiting for its stall timer. At most
            ``MAX_MISSING``, ascending; empty when there is no such gap.
    """

    gateway_id: str
    pipeline: str
    partition: int
    partitions: int
    seq: int
    at_ms: int
    missing: tuple[int, ...] = ()

    def to_json(self) -> bytes:
        """Encode for the wire (``missing`` only when there is a gap)."""
        body: dict[str, Any] = {
            "shoal": SCHEMA_VERSION,
            "gateway_id": self.gateway_id,
            "pipeline": self.pipeline,
            "partition": self.partition,
            "partitions": self.partitions,
            "seq": self.seq,
            "at": self.at_ms,
        }
        if self.missing:
            body["missing"] = list(self.missing)
        return orjson.dumps(body)

    @classmethod
    def from_json(cls, payload: bytes) -> Self:
        """Decode and validate; raises ``SchemaError``."""
        obj = _load(payload, "confirm")
        partitions = require_int(obj.get("partitions"), "partitions", 1, 4096)
        seq = require_int(obj.get("seq"), "seq", -1, MAX_SEQ)
        return cls(
            gateway_id=_name(obj, "gateway_id"),
            pipeline=_name(obj, "pipeline"),
            partition=require_int(obj.get("partition"), "partition", 0, partitions - 1),
            partitions=partitions,
            seq=seq,
            at_ms=require_int(obj.get("at"), "at", 0, MAX_TS_MS),
            missing=_missing(obj.get("missing", []), seq),
        )


MAX_MISSING: Final = 256
"""Most seqs one confirmation names as missing."""


def _missing(value: object, seq: int) -> tuple[int, ...]:
    """The ``missing`` list of a confirmation: ascending seqs above ``seq``, at most 256."""
    if not isinstance(value, list) or len(value) > MAX_MISSING:
        raise SchemaError(
            "invalid missing list",
            reason="bad_type",
            field="missing",
            expected=f"an array of at most {MAX_MISSING} seqs",
            found=describe(value),
        )
    seqs = tuple(require_int(v, "missing", seq + 1, MAX_SEQ) for v in value)
    if any(b <= a for a, b in itertools.pairwise(seqs)):
        raise SchemaError(
            "missing seqs out of order",
            reason="out_of_range",
            field="missing",
            expected="strictly ascending seqs",
            found=describe(value),
        )
    return seqs


@dataclass(frozen=True, slots=True)
class GatewayStatus:
    """What a gateway announces about its sequence and spool.

    Attributes:
        gateway_id: the gateway.
        stream: the stream it publishes to.
        next_seq: the seq its next batch will carry.
        first_unconfirmed_seq: lowest seq not yet confirmed (``next_seq`` if none): every
            earlier batch is confirmed, so a combiner meeting this gateway for the first time
            starts counting here.
        unconfirmed_batches: batches published (or waiting to be) but not confirmed.
        unconfirmed_rows: measurements in them.
        oldest_unconfirmed_ms: when the oldest of them was sealed (None if there are none).
        spool_bytes: bytes the spool holds on disk.
        rows_total: measurements sealed into batches since the gateway was created.
        at_ms: gateway clock when sent.
    """

    gateway_id: str
    stream: str
    next_seq: int
    first_unconfirmed_seq: int
    unconfirmed_batches: int
    unconfirmed_rows: int
    oldest_unconfirmed_ms: int | None
    spool_bytes: int
    rows_total: int
    at_ms: int

    def to_json(self) -> bytes:
        """Encode for the wire."""
        return orjson.dumps({"shoal": SCHEMA_VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, payload: bytes) -> Self:
        """Decode and validate; raises ``SchemaError``."""
        obj = _load(payload, "gateway status")
        next_seq = require_int(obj.get("next_seq"), "next_seq", 0, MAX_SEQ)
        oldest = obj.get("oldest_unconfirmed_ms")
        return cls(
            gateway_id=_name(obj, "gateway_id"),
            stream=_name(obj, "stream"),
            next_seq=next_seq,
            first_unconfirmed_seq=require_int(
                obj.get("first_unconfirmed_seq"), "first_unconfirmed_seq", 0, next_seq
            ),
            unconfirmed_batches=require_int(
                obj.get("unconfirmed_batches"), "unconfirmed_batches", 0, MAX_SEQ
            ),
            unconfirmed_rows=require_int(
                obj.get("unconfirmed_rows"), "unconfirmed_rows", 0, MAX_SEQ
            ),
            oldest_unconfirmed_ms=None
            if oldest is None
            else require_int(oldest, "oldest_unconfirmed_ms", 0, MAX_TS_MS),
            spool_bytes=require_int(obj.get("spool_bytes"), "spool_bytes", 0, MAX_SEQ),
            rows_total=require_int(obj.get("rows_total"), "rows_total", 0, MAX_SEQ),
            at_ms=require_int(obj.get("at_ms"), "at_ms", 0, MAX_TS_MS),
        )
