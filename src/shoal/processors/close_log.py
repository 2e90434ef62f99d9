"""The close log: a combiner partition's published decisions, durable before they are published.

Everything a combiner publishes is a pure function of its checkpoint and of *which batches it
had applied when each close ran*: the per-gateway rule, the merge, revisions, sessions and
count windows do not depend on the order of batches between two closes (each batch is judged
against its gateway's own watermark and against the close threshold, which only a close
moves). What is not a function of the data is the timing of the closes themselves: a window
that closed while a gateway was idle takes that gateway's later rows as late (or as a
correction), and a restored combiner, re-applying the re-sent batches, would interleave them
with its closes differently and publish other content under the same identity and revision.

So before a close (or a ``flush``) is published, the combiner appends one entry to this log:
its threshold and the *applied vector* (per gateway, the next seq to apply: every batch below
it was applied before the close). A restored combiner re-takes those decisions: it applies the
re-sent batches below the next entry's vector, holds those above it, and runs the close once
every batch below the vector is back, so every close, late report and correction it publishes
is the one published before the crash; the log's last entry done, it runs freely again.

The log follows the last durable checkpoint. Its file is a msgpack stream: a header naming the
checkpoint generation it follows (``after``), then entries ``close``/``flush`` and ``mark``
(a snapshot was taken here, with the generation it will have). Vectors are stored as changes
since the previous entry. Once a checkpoint is durable the entries up to its mark are dropped
from memory, and the file is rewritten with the entries after the mark only once what it holds
before them reaches ``COMPACT_BYTES``: a rewrite costs two flushes to disk, and a pool combiner
checkpointing 1,000 partitions every second would otherwise rewrite 1,000 files a second. A
restore reads the entries after the restored checkpoint (all of them when the header names it,
those after its mark when the header is older: not rewritten since, or a crash between the
checkpoint and the rewrite). The runtime appends
entries before it publishes what they decide (``take``) and flushes the file to disk when an
entry decides a close.

Pure: no files, no clock (``shoal.runtime.combiner`` does the IO).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgpack

from shoal.errors import SchemaError

LOG_VERSION: Final = 1
COMPACT_BYTES: Final = 64 * 1024
"""Bytes of entries before the last durable checkpoint's mark that the file may hold."""

Kind = Literal["close", "flush"]


@dataclass(frozen=True, slots=True)
class Decision:
    """One logged close or flush, with the applied vector it ran at (cumulative)."""

    kind: Kind
    threshold: int | None
    applied: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class LogWrite:
    """Bytes for the runtime to write: appended, or replacing the file (``replace``).

    ``sync``: they hold a decision, so flush them to disk before publishing it.
    """

    data: bytes
    replace: bool
    sync: bool


@dataclass
class CloseLog:
    """The close log of one combiner partition (see the module docstring)."""

    generation: int = 0
    """Generation of the latest snapshot taken (0: none)."""
    enabled: bool = True
    """False: nothing is recorded (a combiner without checkpoints has nothing to replay)."""
    _base: dict[str, int] = field(default_factory=dict)
    _entries: list[bytes] = field(default_factory=list)
    _after: int = 0
    _written: int = 0
    _replace: bool = True
    _sync: bool = False
    _stale: int = 0
    """Bytes in the file before the entries still needed (``settle``)."""

    # -- writing -------------------------------------------------------------------------------

    def record(self, decision: Decision, *, sync: bool = True) -> None:
        """Append a close or flush decided now (``applied``: the vector it ran at).

        ``sync``: it publishes something, so the runtime flushes the log to disk first (a
        close that only moves the threshold is written, not flushed: see docs/guarantees.md
        "kill -9 versus power loss").
        """
        if self.enabled:
            self._append(decision.kind, decision.applied, threshold=decision.threshold)
            self._sync = self._sync or sync

    def mark(self, applied: Mapping[str, int]) -> int:
        """Note that a snapshot is taken now; returns the generation it has."""
        self.generation += 1
        if self.enabled:
            self._append("mark", applied, generation=self.generation)
        return self.generation

    def _append(self, kind: str, applied: Mapping[str, int], **extra: Any) -> None:
        changed = {g: s for g, s in applied.items() if self._base.get(g) != s}
        self._base = dict(applied)
        self._entries.append(_pack({"k": kind, "v": changed, **extra}))

    def take(self) -> LogWrite | None:
        """What the runtime must write before publishing anything decided so far."""
        if not self.enabled:
            return None
        if self._replace:
            data = _pack({"k": "header", "after": self._after, "v": LOG_VERSION})
            data += b"".join(self._entries)
            write = LogWrite(data, replace=True, sync=True)
            self._stale = 0
        elif self._written < len(self._entries):
            write = LogWrite(b"".join(self._entries[self._written :]), False, self._sync)
        else:
            return None
        self._written = len(self._entries)
        self._replace = self._sync = False
        return write

    def settle(self, generation: int) -> None:
        """The snapshot of ``generation`` is durable: keep only the entries after its mark.

        The file keeps the older ones (a restore skips them) until they reach
        ``COMPACT_BYTES``; then the next ``take`` rewrites it.
        """
        for i in range(len(self._entries) - 1, -1, -1):
            entry = _unpack_one(self._entries[i])
            if entry.get("k") == "mark" and entry.get("generation") == generation:
                # Changes after the mark are relative to it, i.e. to the snapshot: still valid.
                dropped = self._entries[: i + 1]
                self._entries = self._entries[i + 1 :]
                self._stale += sum(len(e) for e in dropped)
                if self._replace or self._written < len(dropped) or self._stale >= COMPACT_BYTES:
                    # Rewritten anyway, its mark not in the file yet, or enough to drop.
                    self._after, self._replace = generation, True
                else:
                    self._written -= len(dropped)
                return

    # -- restoring -----------------------------------------------------------------------------

    def load(
        self, data: bytes | None, generation: int, applied: Mapping[str, int]
    ) -> list[Decision]:
        """Restore the log for the snapshot of ``generation`` (vector ``applied``).

        Returns the decisions taken after that snapshot, in order, to be re-taken. The log
        then holds exactly them (rewritten on the next ``take``), so a crash during their
        replay replays them again.
        """
        self.generation = self._after = generation
        self._entries, self._written, self._replace = [], 0, True
        self._base = dict(applied)
        entries = _entries_after(_unpack_all(data), generation) if data else []
        decisions: list[Decision] = []
        vector = dict(applied)
        for entry in entries:
            vector = {**vector, **_changes(entry)}
            if entry.get("k") in ("close", "flush"):
                threshold = entry.get("threshold")
                if threshold is not None and not isinstance(threshold, int):
                    raise SchemaError("close log: a threshold is not an integer", reason="bad_log")
                decision = Decision(entry["k"], threshold, vector)
                decisions.append(decision)
                self.record(decision)
        return decisions

    def keep(self, decisions: list[Decision], restored: Mapping[str, int]) -> None:
        """Keep only ``decisions`` (re-taken ones) after giving up the rest of a replay."""
        self._entries, self._written, self._replace = [], 0, True
        self._base = dict(restored)
        for decision in decisions:
            self.record(decision)


def _pack(obj: dict[str, Any]) -> bytes:
    packed = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def _unpack_one(data: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(data, raw=False)
    assert isinstance(obj, dict)
    return obj


def _unpack_all(data: bytes) -> list[dict[str, Any]]:
    """The entries of a log file; a torn last entry (a crash mid-write) is left out."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    entries: list[dict[str, Any]] = []
    try:
        for obj in unpacker:
            if not isinstance(obj, dict):
                raise SchemaError("close log: an entry is not a map", reason="bad_log")
            entries.append(obj)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SchemaError(f"close log unreadable: {exc}", reason="bad_log") from exc
    return entries


def _entries_after(entries: list[dict[str, Any]], generation: int) -> list[dict[str, Any]]:
    """The entries decided after the snapshot of ``generation``."""
    if not entries or entries[0].get("k") != "header" or entries[0].get("v") != LOG_VERSION:
        raise SchemaError("close log without a header of this version", reason="bad_log")
    after = entries[0].get("after")
    body = entries[1:]
    if after == generation:
        return body
    marks = [
        i for i, e in enumerate(body) if e.get("k") == "mark" and e.get("generation") == generation
    ]
    if isinstance(after, int) and after < generation and marks:
        return body[marks[-1] + 1 :]
    return []  # a log of an older life than the checkpoint's, or of another one: nothing to do


def _changes(entry: dict[str, Any]) -> dict[str, int]:
    changed = entry.get("v", {})
    if not isinstance(changed, dict) or not all(
        isinstance(g, str) and isinstance(s, int) for g, s in changed.items()
    ):
        raise SchemaError("close log: an applied vector is malformed", reason="bad_log")
    return changed
