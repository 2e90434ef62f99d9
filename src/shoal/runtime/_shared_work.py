"""What a pool worker's pipelines share when they read the same batch: its decode and partials.

A pool worker serving N pipelines on one input receives each batch up to N times: one copy per
pipeline's shared subscription (the broker deals every group its own copy, and a worker is a
member of each group). The copies are the same bytes, and they arrive one after the other
(the broker queues a publish for all its subscriptions at once). ``SharedWork`` remembers the
work done for the last few payloads so that each copy after the first costs a lookup:

* **the decode**, for every pipeline whose decode limits give the same batch: limits that only
  refuse (payload size, rows, string length, decompressed size) may differ, as long as this
  pipeline's are at least as wide as those of a decode that succeeded; the others (the
  timestamp bounds and ``on_future``, which may change timestamps) must be equal;
* **the partials**, for every pipeline with the same ``spec_fingerprint`` (the fingerprint is
  what combiners check: everything that shapes a partial) on the same decode; each pipeline
  gets them under its own name.

The copies after the first are handled as if they had arrived with the first: the decode's
clock checks and the partials' times are the first copy's. A remembered payload older than
``max_age_s`` is decoded afresh (a gateway's re-send long after is judged at its own arrival).
Refused batches are not remembered: each pipeline refuses (and dead-letters) its copy itself.
Memory is bounded by design: ``size`` payloads, each with its decodes and one list of partials
per fingerprint of the pipelines that read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Final

from shoal.broker.session import Message
from shoal.processors.partials import BatchInfo, Partial
from shoal.schemas import Batch, DecodeLimits

REFUSING_LIMITS: Final = (
    "max_payload_bytes",
    "max_rows",
    "max_string_bytes",
    "max_decompressed_bytes",
)
"""``DecodeLimits`` fields that only refuse a batch: a wider one accepts the same batch."""


def covers(done: DecodeLimits, wanted: DecodeLimits) -> bool:
    """Whether a batch decoded under ``done`` is what decoding under ``wanted`` gives.

    Every refusing limit of ``wanted`` is at least ``done``'s, and every other field equal.
    """
    if any(getattr(wanted, f) < getattr(done, f) for f in REFUSING_LIMITS):
        return False
    return replace(wanted, **{f: getattr(done, f) for f in REFUSING_LIMITS}) == done


@dataclass(slots=True)
class _Decoded:
    limits: DecodeLimits
    batch: Batch
    info: BatchInfo
    now_ms: int
    partials: dict[str, list[Partial]] = field(default_factory=dict)
    """By spec fingerprint (made for the first pipeline of each)."""


@dataclass(slots=True)
class _Payload:
    at_s: float
    decoded: list[_Decoded] = field(default_factory=list)


@dataclass(slots=True)
class SharedCounters:
    """How often copies found their work done (kept in the process: ``PoolRoutes.shared``)."""

    decodes: int = 0
    decodes_reused: int = 0
    builds: int = 0
    builds_reused: int = 0

    def as_dict(self) -> dict[str, int]:
        """The heartbeat's ``shared``."""
        return {
            "decodes": self.decodes,
            "decodes_reused": self.decodes_reused,
            "builds": self.builds,
            "builds_reused": self.builds_reused,
        }


Decode = Callable[[], tuple[Batch, BatchInfo]]
Build = Callable[[Batch, BatchInfo, int], list[Partial]]


class SharedWork:
    """The decodes and partials of the last ``size`` payloads (see the module docstring).

    Args:
        monotonic: the worker's monotonic clock (seconds).
        size: payloads remembered.
        max_age_s: a payload remembered longer is decoded afresh.
    """

    def __init__(
        self, monotonic: Callable[[], float], *, size: int = 2, max_age_s: float = 1.0
    ) -> None:
        self._monotonic = monotonic
        self._size = size
        self._max_age_s = max_age_s
        self._payloads: OrderedDict[tuple[str, str | None, int | None, bytes], _Payload] = (
            OrderedDict()
        )
        self.counters = SharedCounters()

    def decode(
        self, message: Message, limits: DecodeLimits, now_ms: int, decode: Decode
    ) -> tuple[Batch, BatchInfo, int]:
        """The batch, its info and the time it was decoded at: remembered, or ``decode()``.

        ``decode`` raises ``InputError`` for a refused batch (nothing is remembered then).
        """
        key = (message.topic, message.content_type, message.payload_format, message.payload)
        now_s = self._monotonic()
        entry = self._payloads.get(key)
        if entry is not None and now_s - entry.at_s > self._max_age_s:
            del self._payloads[key]
            entry = None
        if entry is not None:
            for done in entry.decoded:
                if covers(done.limits, limits):
                    self.counters.decodes_reused += 1
                    return done.batch, done.info, done.now_ms
        batch, info = decode()
        self.counters.decodes += 1
        if entry is None:
            entry = self._payloads[key] = _Payload(now_s)
            while len(self._payloads) > self._size:
                self._payloads.popitem(last=False)
        entry.decoded.append(_Decoded(limits, batch, info, now_ms))
        return batch, info, now_ms

    def partials(
        self, batch: Batch, fingerprint: str, pipeline: str, build: Callable[[], list[Partial]]
    ) -> list[Partial]:
        """The partials of ``batch`` for a spec with ``fingerprint``, named ``pipeline``.

        ``batch`` must come from ``decode``; the partials are made by ``build()`` for the
        first pipeline of a fingerprint and renamed for the others.
        """
        done = self._find(batch)
        if done is None:  # not remembered (evicted meanwhile): nothing to share
            self.counters.builds += 1
            return build()
        made = done.partials.get(fingerprint)
        if made is None:
            made = done.partials[fingerprint] = build()
            self.counters.builds += 1
            return made
        self.counters.builds_reused += 1
        return [p if p.pipeline == pipeline else replace(p, pipeline=pipeline) for p in made]

    def _find(self, batch: Batch) -> _Decoded | None:
        for entry in reversed(self._payloads.values()):
            for done in entry.decoded:
                if done.batch is batch:
                    return done
        return None
