"""Deduplicate window messages and assemble a window's partitions into one frame (pure).

With ``partitions > 1`` every combiner partition publishes its own message per window, holding
only its keys, and a partition that has no key in a window publishes nothing for it. A window
is therefore *complete* once every partition has either sent its message or shown that it is
past the window:

* a partition publishes the windows it closes in order of (end, name), and its messages
  arrive in that order (one publisher, one topic), so a message for (end E, name N) shows
  that the partition has published everything ordered before (E, N). (The ``watermark`` in
  the header is no such evidence: windows closed in the same step follow the message.)
* combiner heartbeats (``note_progress``) carry the partition's close threshold, but they
  travel at QoS 0 and can overtake result messages published just before them, so a
  heartbeat counts only once it is ``settle_ms`` old.

A window that stays incomplete for ``max_wait_ms`` (a partition is down, or its heartbeats are
not readable) is released with what arrived, flagged ``complete=False``.

A window too large for one broker packet comes from a partition as several messages
(``WindowMessage.part`` of ``parts``, each with some of its keys): the partition counts as
sent once every part of one revision arrived; parts of two revisions are never mixed (a part
of a later revision starts a new set, which replaces the partition's held set only once it is
whole; a window released incomplete carries the parts that arrived).

Corrections (a higher ``revision`` of a partition's window, pipelines with allowed lateness)
replace that partition's part: a window still pending takes it in; a window already released
is released again at once, with the other partitions' latest parts (remembered for the last
``remember_windows`` windows) and the highest revision among its parts. A copy that is not
later (``WindowMessage.rank``) than the part already held is dropped. A session window's
retraction rows (``superseded_by``: the key's session moved to another start, whose window
carries it) are left out of the assembled frame.

Must not import ``shoal.broker``: the client feeds it messages and a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

import polars as pl

from shoal.schemas.results import RETRACTED, Deduplicator, WindowMessage

DEFAULT_MAX_WAIT_MS: Final = 10_000
DEFAULT_SETTLE_MS: Final = 1_000
DEFAULT_REMEMBER_WINDOWS: Final = 256
"""Released windows of partitioned pipelines whose parts are kept for a later correction."""


@dataclass(frozen=True, slots=True)
class AssembledWindow:
    """One window of one pipeline with the keys of every partition.

    Attributes:
        pipeline: the pipeline.
        window: window name.
        start: window start, epoch ms.
        end: window end, epoch ms.
        revision: the highest revision among its parts (above 1: a correction).
        frame: every key's result row (result layout), sorted by key.
        partitions_seen: partitions whose message is included.
        complete: every partition either sent its keys or closed past the window.
    """

    pipeline: str
    window: str
    start: int
    end: int
    revision: int
    frame: pl.DataFrame
    partitions_seen: tuple[int, ...]
    complete: bool


@dataclass
class _Split:
    """The messages of one revision of one partition's window (one, or its parts)."""

    messages: dict[int, WindowMessage] = field(default_factory=dict)

    @property
    def whole(self) -> bool:
        first = next(iter(self.messages.values()))
        return len(self.messages) == first.parts

    @property
    def rank(self) -> tuple[int, int]:
        first = next(iter(self.messages.values()))
        return (first.revision, sum(m.rows for m in self.messages.values()))

    def accepts(self, message: WindowMessage) -> bool:
        """Whether ``message`` belongs to this set (same revision and part count)."""
        first = next(iter(self.messages.values()))
        return (message.revision, message.parts) == (first.revision, first.parts)

    def take(self, message: WindowMessage) -> bool:
        """Add a part, or replace it by a later copy; False if it is no later."""
        held = self.messages.get(message.part)
        if held is not None and message.rank <= held.rank:
            return False
        self.messages[message.part] = message
        return True


@dataclass
class _Pending:
    first: WindowMessage
    arrived_ms: int
    parts: dict[int, _Split] = field(default_factory=dict)
    """Per partition: the whole set of messages assembled (the latest one complete)."""
    incoming: dict[int, _Split] = field(default_factory=dict)
    """Per partition: a set of parts still arriving, later than the one in ``parts``."""

    def take(self, message: WindowMessage) -> bool:
        """Take one message of a partition; True if the partition's whole set changed."""
        partition = message.partition
        held = self.parts.get(partition)
        if message.parts == 1:
            if held is not None and (message.revision, message.rows) <= held.rank:
                return False
            self.parts[partition] = _Split({0: message})
            split = self.incoming.get(partition)
            if split is not None and split.rank[0] <= message.revision:
                del self.incoming[partition]
            return True
        if held is not None and message.revision < held.rank[0]:
            return False
        split = self.incoming.get(partition)
        if split is None or not split.accepts(message):
            if held is not None and held.accepts(message):
                return held.take(message) and held.whole
            if (
                split is not None
                and message.revision < next(iter(split.messages.values())).revision
            ):
                return False
            split = self.incoming[partition] = _Split()
        if not split.take(message) or not split.whole:
            return False
        if held is not None and split.rank[0] < held.rank[0]:
            return False
        self.parts[partition] = self.incoming.pop(partition)
        return True

    def messages(self, *, partial: bool) -> list[WindowMessage]:
        """The messages to assemble, by partition; ``partial``: parts still arriving too."""
        out: list[WindowMessage] = []
        for partition in sorted({*self.parts, *(self.incoming if partial else ())}):
            split = self.parts.get(partition)
            if split is None or not split.whole:
                split = self.incoming.get(partition, split) if partial else split
            if split is not None:
                out.extend(split.messages[p] for p in sorted(split.messages))
        return out


_WindowKey = tuple[str, str, int]  # pipeline, window, start


class WindowAssembler:
    """Joins partition messages of a window; see the module docstring for completeness.

    Feed ``add`` (messages, deduplicated here), ``note_progress`` (a partition's close
    threshold from a heartbeat) and ``expire`` (time passing); each returns the windows that
    became ready, oldest end first.
    """

    def __init__(
        self,
        max_wait_ms: int = DEFAULT_MAX_WAIT_MS,
        dedup: Deduplicator | None = None,
        settle_ms: int = DEFAULT_SETTLE_MS,
        remember_windows: int = DEFAULT_REMEMBER_WINDOWS,
    ) -> None:
        self.max_wait_ms = max_wait_ms
        self.settle_ms = settle_ms
        self.dedup = dedup or Deduplicator()
        self._pending: dict[_WindowKey, _Pending] = {}
        self.remember_windows = remember_windows
        self._released: OrderedDict[_WindowKey, _Pending] = OrderedDict()
        self._ranks: OrderedDict[_WindowKey, tuple[int, int]] = OrderedDict()
        self._closed_through: dict[tuple[str, int], int] = {}
        self._sent_through: dict[tuple[str, int], tuple[int, str]] = {}
        self._beats: dict[tuple[str, int], list[tuple[int, int]]] = {}

    @property
    def pending(self) -> int:
        """Windows waiting for more partitions."""
        return len(self._pending)

    def add(self, message: WindowMessage, now_ms: int) -> list[AssembledWindow]:
        """Take one message (a duplicate is dropped); return the windows now ready."""
        if not self.dedup.first_time(message.copy_key):
            return []
        source = (message.pipeline, message.partition)
        position = (message.end, message.window)
        if position > self._sent_through.get(source, (-(2**62), "")):
            self._sent_through[source] = position
        key = (message.pipeline, message.window, message.start)
        if message.partitions <= 1 and message.parts == 1:
            if message.rank <= self._ranks.get(key, (0, -1)):
                return self._ready(now_ms)  # a stale copy (re-published after a restart)
            self._note_rank(key, message.rank)
            return [*self._ready(now_ms), _assemble([message], complete=True)]
        if message.partitions <= 1 and message.revision < self._ranks.get(key, (0, -1))[0]:
            return self._ready(now_ms)  # a part of a revision already superseded
        released = self._released.get(key)
        if released is not None:  # a correction of a window already released
            if not released.take(message):
                return self._ready(now_ms)
            self._remember(key, released)
            return [*self._ready(now_ms), self._assembled(released)]
        pending = self._pending.setdefault(key, _Pending(message, now_ms))
        pending.take(message)
        return self._ready(now_ms)

    def _note_rank(self, key: _WindowKey, rank: tuple[int, int]) -> None:
        """The latest (revision, rows) delivered of a single-partition window."""
        self._ranks[key] = rank
        self._ranks.move_to_end(key)
        while len(self._ranks) > self.dedup.capacity:
            self._ranks.popitem(last=False)

    def note_progress(
        self, pipeline: str, partition: int, closed_through: int | None, now_ms: int
    ) -> list[AssembledWindow]:
        """A heartbeat: the partition closed every window ending at or before ``closed_through``.

        Counts once it is ``settle_ms`` old (see the module docstring).
        """
        if closed_through is not None:
            beats = self._beats.setdefault((pipeline, partition), [])
            if not beats or closed_through > beats[-1][0]:
                beats.append((closed_through, now_ms))
        return self._ready(now_ms)

    def expire(self, now_ms: int) -> list[AssembledWindow]:
        """Windows that are complete, or waited ``max_wait_ms`` (released incomplete)."""
        return self._ready(now_ms)

    def flush(self) -> list[AssembledWindow]:
        """Everything pending, complete or not (at the end of a stream)."""
        out = [self._release(key) for key in list(self._pending)]
        return sorted(out, key=lambda w: (w.end, w.window, w.start))

    def _note(self, pipeline: str, partition: int, closed_through: int) -> None:
        key = (pipeline, partition)
        if closed_through > self._closed_through.get(key, -(2**62)):
            self._closed_through[key] = closed_through

    def _is_complete(self, pending: _Pending) -> bool:
        first = pending.first
        position = (first.end, first.window)
        return all(
            (p in pending.parts and pending.parts[p].whole)
            or self._sent_through.get((first.pipeline, p), (-(2**62), "")) > position
            or self._closed_through.get((first.pipeline, p), -(2**62)) >= first.end
            for p in range(first.partitions)
        )

    def _settle(self, now_ms: int) -> None:
        for (pipeline, partition), beats in self._beats.items():
            while beats and now_ms - beats[0][1] >= self.settle_ms:
                self._note(pipeline, partition, beats.pop(0)[0])

    def _ready(self, now_ms: int) -> list[AssembledWindow]:
        self._settle(now_ms)
        ready = [
            key
            for key, pending in self._pending.items()
            if self._is_complete(pending) or now_ms - pending.arrived_ms >= self.max_wait_ms
        ]
        out = [self._release(key) for key in ready]
        return sorted(out, key=lambda w: (w.end, w.window, w.start))

    def _release(self, key: _WindowKey) -> AssembledWindow:
        """Release a pending window: with the parts still arriving if it is incomplete."""
        pending = self._pending.pop(key)
        self._remember(key, pending)
        return self._assembled(pending, partial=True)

    def _assembled(self, pending: _Pending, *, partial: bool = False) -> AssembledWindow:
        complete = self._is_complete(pending)
        window = _assemble(pending.messages(partial=partial and not complete), complete=complete)
        if pending.first.partitions <= 1 and complete:  # later whole messages compare with it
            key = (window.pipeline, window.window, window.start)
            self._note_rank(key, (window.revision, int(window.frame["rows"].sum())))
        return window

    def _remember(self, key: _WindowKey, parts: _Pending) -> None:
        self._released[key] = parts
        self._released.move_to_end(key)
        while len(self._released) > self.remember_windows:
            self._released.popitem(last=False)


def _assemble(parts: list[WindowMessage], *, complete: bool) -> AssembledWindow:
    first = parts[0]
    frame = (
        parts[0].frame
        if len(parts) == 1
        else pl.concat([p.frame for p in parts], how="diagonal_relaxed")
    )
    if RETRACTED in frame.columns:  # a session that moved to another start: not a result here
        frame = frame.filter(pl.col(RETRACTED).is_null()).drop(RETRACTED)
    return AssembledWindow(
        pipeline=first.pipeline,
        window=first.window,
        start=first.start,
        end=first.end,
        revision=max(p.revision for p in parts),
        frame=frame.sort("key", nulls_last=True),
        partitions_seen=tuple(sorted({p.partition for p in parts})),
        complete=complete,
    )
