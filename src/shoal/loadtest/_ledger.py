"""The consumer's side of a count oracle: every window result and late report, deduplicated.

``Ledger`` folds what a pipeline publishes on ``results/<pipeline>``, ``shoal/late/<pipeline>``
and ``shoal/deadletter/<pipeline>`` into counts, the way an exactly-once consumer must: a window
message is identified by ``(window, start, partition, revision, part)`` (``part`` 0 when the
window was not split to fit the broker's packet limit) and a late report by
``(partition, gateway, seq)``; a second copy with the same identity (a combiner restarted
after publishing it) is counted once, and a copy whose row count differs is a conflict.
``follow`` keeps a persistent QoS 1 session on those topics across broker restarts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson

from shoal.broker import AsyncSession
from shoal.broker.session import Message
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError
from shoal.processors.results import late_memberships
from shoal.schemas.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class Ledger:
    """Deduplicated counts of what a pipeline emitted (see the module docstring).

    Attributes:
        pipeline: the pipeline followed.
        window: the window spec whose results count rows (each row is in exactly one of its
            windows); None takes the first name seen.
        windows: rows per window-message identity.
        parts: how many parts each (window, start, partition, revision) was published in.
        late: rows per late-report identity.
        republished: copies of window messages already counted (same identity, same rows).
        conflicts: copies with the same identity and a different row count (must stay 0).
        deadletters: dead-letter records, and their reasons.
    """

    pipeline: str
    window: str | None = None
    windows: dict[tuple[str, int, int, int, int], int] = field(default_factory=dict)
    parts: dict[tuple[str, int, int, int], int] = field(default_factory=dict)
    late: dict[tuple[int, str, int], int] = field(default_factory=dict)
    republished: int = 0
    conflicts: int = 0
    conflict_rows: int = 0
    deadletters: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    unreadable: int = 0

    def filters(self, topics: Topics) -> list[str]:
        """The topics to follow."""
        return [
            topics.results(self.pipeline),
            topics.late(self.pipeline),
            topics.deadletter(self.pipeline),
        ]

    def take(self, topics: Topics, message: Message) -> None:
        """Fold one message in."""
        try:
            if message.topic == topics.results(self.pipeline):
                self._window(orjson.loads(message.payload))
            elif message.topic == topics.late(self.pipeline):
                self._late(orjson.loads(message.payload))
            elif message.topic == topics.deadletter(self.pipeline):
                self._deadletter(message.payload)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            self.unreadable += 1

    def _window(self, body: dict[str, Any]) -> None:
        if self.window is None:
            self.window = str(body["window"])
        if body["window"] != self.window:
            return
        identity = (
            str(body["window"]),
            int(body["start"]),
            int(body["partition"]),
            int(body["revision"]),
            int(body.get("part", 0)),
        )
        self.parts[identity[:4]] = int(body.get("parts", 1))
        rows = int(body["rows"])
        seen = self.windows.get(identity)
        if seen is None:
            self.windows[identity] = rows
        elif seen == rows:
            self.republished += 1
        else:
            self.conflicts += 1
            self.conflict_rows += abs(rows - seen)

    def _late(self, body: dict[str, Any]) -> None:
        identity = (int(body["partition"]), str(body["gateway_id"]), int(body["seq"]))
        # By the window spec whose results count rows, as ``rows_in_results`` does.
        self.late.setdefault(identity, late_memberships(body, self.window))

    def _deadletter(self, payload: bytes) -> None:
        record = msgpack.unpackb(payload, raw=False)
        self.deadletters += 1
        self.reasons[str(record["error"]["reason"])] += 1

    @property
    def rows_in_results(self) -> int:
        """Rows in the results: per (window, start, partition), its latest revision's rows.

        A correction (revision above 1) is the whole window of its partition again, so the
        latest revision alone counts every row the window holds: the sum over that revision's
        parts (never parts of two revisions).
        """
        latest = self._latest_revisions()
        return sum(
            rows
            for (window, start, partition, revision, _), rows in self.windows.items()
            if latest[(window, start, partition)] == revision
        )

    @property
    def missing_parts(self) -> int:
        """Parts of the latest revisions not received yet (0 once every window is whole)."""
        latest = self._latest_revisions()
        got = Counter(identity[:4] for identity in self.windows)
        return sum(
            self.parts[(*key, revision)] - got[(*key, revision)] for key, revision in latest.items()
        )

    def _latest_revisions(self) -> dict[tuple[str, int, int], int]:
        """The latest revision seen of each (window, start, partition).

        ``parts`` has a key for every window message's identity but its part, so it serves.
        """
        latest: dict[tuple[str, int, int], int] = {}
        for window, start, partition, revision in self.parts:
            key = (window, start, partition)
            latest[key] = max(latest.get(key, revision), revision)
        return latest

    @property
    def corrections(self) -> int:
        """Distinct correction messages (revision above 1), counting each part."""
        return sum(1 for identity in self.windows if identity[3] > 1)

    @property
    def late_rows(self) -> int:
        """Rows reported late, by distinct report."""
        return sum(self.late.values())


async def follow(
    settings: BrokerSettings,
    topics: Topics,
    ledger: Ledger,
    client_id: str,
    ready: asyncio.Event,
) -> None:
    """Feed ``ledger`` until cancelled, through broker restarts (persistent QoS 1 session)."""
    while True:
        session = AsyncSession(settings, client_id, clean_start=False, session_expiry_s=3600)
        try:
            async with session:
                await session.subscribe(ledger.filters(topics), qos=1)
                ready.set()
                async for message in session.messages():
                    ledger.take(topics, message)
        except BrokerError as exc:
            log.info("ledger: %s; reconnecting", exc)
            await asyncio.sleep(0.3)
