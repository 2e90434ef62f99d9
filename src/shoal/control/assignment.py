"""Who owns which (pipeline, partition): rendezvous hashing over the live pool combiners. Pure.

Every pool combiner announces itself with a retained message on ``shoal/combiners/<id>``
(``Announcement``; its Will clears it when the process dies) and reads every other's. Each
computes, for every partition of every deployed pipeline, the member with the highest
``weight(member, pipeline, partition)`` (highest-random-weight hashing): all agree without a
coordinator once they see the same members, and when a member joins or leaves only the
partitions it wins or held move. The broker, not this function, guarantees that at most one
process serves a partition at a time (docs/architecture.md, "The combiner pool"): this only
decides who *should*.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from shoal.errors import ControlError

Slot = tuple[str, int]
"""(pipeline, partition)."""


def weight(member: str, pipeline: str, partition: int) -> int:
    """The member's rendezvous weight for one partition (stable across processes and runs)."""
    key = f"{member}\x00{pipeline}\x00{partition}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def owner(members: Iterable[str], pipeline: str, partition: int) -> str | None:
    """The member that owns ``(pipeline, partition)`` (None: no live member)."""
    best: tuple[int, str] | None = None
    for member in members:
        candidate = (weight(member, pipeline, partition), member)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else best[1]


def owned_by(me: str, members: Iterable[str], partitions: Mapping[str, int]) -> set[Slot]:
    """The slots ``me`` owns, given every pipeline's partition count (``me`` counts as live)."""
    live = {*members, me}
    return {
        (name, partition)
        for name, count in partitions.items()
        for partition in range(count)
        if owner(live, name, partition) == me
    }


@dataclass(frozen=True, slots=True)
class Owned:
    """A partition a pool combiner serves now: which pipeline version, of how many partitions.

    ``open`` lists every version whose windows it still computes, oldest first (older ones
    finish the windows before an update's cut): a pool worker keeps computing partials of a
    version while a partition lists it (``shoal.runtime.pool``). Empty: just ``version``.
    """

    pipeline: str
    partition: int
    partitions: int
    version: int
    open: tuple[int, ...] = ()

    @property
    def oldest(self) -> int:
        """The oldest version this partition still computes windows of."""
        return min(self.open, default=self.version)


@dataclass(frozen=True, slots=True)
class Announcement:
    """A pool combiner's retained presence on ``shoal/combiners/<id>`` (CONTRACT.md §23).

    ``owns`` lists only partitions it has taken the session of and restored, so a reader
    (``shoal pipeline deploy``) knows a listed partition is running.
    """

    id: str
    at: int
    owns: tuple[Owned, ...] = ()

    def to_json(self) -> bytes:
        """The retained payload."""
        return orjson.dumps(
            {
                "v": 1,
                "component": "combiner-pool",
                "id": self.id,
                "at": self.at,
                "owns": [
                    {
                        "pipeline": o.pipeline,
                        "partition": o.partition,
                        "partitions": o.partitions,
                        "version": o.version,
                        **({"open": list(o.open)} if o.open else {}),
                    }
                    for o in self.owns
                ],
            }
        )

    @classmethod
    def from_json(cls, payload: bytes) -> Announcement:
        """Decode strictly.

        Raises:
            ControlError: not an announcement (``invalid_announcement``).
        """
        try:
            body: Any = orjson.loads(payload)
            owns = tuple(
                Owned(
                    str(o["pipeline"]),
                    int(o["partition"]),
                    int(o["partitions"]),
                    int(o["version"]),
                    tuple(int(v) for v in o.get("open", ())),
                )
                for o in body["owns"]
            )
            if body.get("v") != 1 or body.get("component") != "combiner-pool":
                raise TypeError("not a combiner-pool announcement, v1")  # noqa: TRY301 - one refusal path
            return cls(str(body["id"]), int(body["at"]), owns)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ControlError(
                f"not a combiner announcement: {exc}", reason="invalid_announcement"
            ) from exc
