"""The pool: a worker serving every deployed pipeline over one MQTT session.

``shoal worker`` without ``--pipeline`` follows the retained pipeline documents
(``shoal/pipelines/+``, read by ``shoal.control.follower``) and, for each deployed
pipeline, holds a ``BatchHandler`` (that version's spec and ``PartialBuilder``) and a shared
subscription ``$share/<pipeline>/<input>`` with a subscription identifier of its own. Two
pipelines may read the same input: the broker delivers a copy per group, each naming its
subscription, and the identifier picks the handler. Pool and pinned workers of a pipeline
are members of the same group.

Changes, in the order they take effect (docs/architecture.md, "The worker pool"):

* **deploy**: build the handler, SUBSCRIBE with a new identifier; from then on the broker
  deals the pipeline's batches to this worker too.
* **update** (a new version): build the new handler and SUBSCRIBE the new version's inputs
  with a new identifier (the same filter again replaces the subscription), UNSUBSCRIBE the
  inputs it no longer reads, then *retire* the old identifier.
* **delete**: UNSUBSCRIBE, then retire.
* **retire**: publish a marker to the worker's own control topic. UNSUBSCRIBE (or a
  replacing SUBSCRIBE) does not flush what the broker already queued for us, and those
  messages carry the old identifier; the marker is queued behind them, so until it comes
  back they still go to the old handler (and are acknowledged as usual), after it nothing
  can: the old handler is dropped.

Per pipeline the pool holds a handler and a few dictionary entries: no task, thread or
connection. A delivery no served pipeline claims is counted (``unrouted``), logged and
acknowledged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from shoal.broker.session import MAX_SUBSCRIPTION_ID, Message, Session
from shoal.clock import Clock
from shoal.control.follower import DocumentFollower, Dropped, Served
from shoal.control.messages import Marker
from shoal.runtime._batches import BatchHandler, WorkerStats
from shoal.schemas.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Pipeline:
    """One served pipeline: its current version, handler and subscription id."""

    version: int
    handler: BatchHandler
    sid: int

    @property
    def filters(self) -> tuple[str, ...]:
        """Its inputs' shared subscriptions (the handler's)."""
        return self.handler.filters


class PoolRoutes:
    """Every deployed pipeline, followed at run time (see the module docstring).

    Args:
        topics: the deployment's topic root.
        worker_id: the worker's id (stamped on partials).
        stats: the worker's counters.
        clock: the worker's clock.
        control_topic: the worker's own control topic (where retire markers go).
        on_change: called when what the pool serves changed (the worker then sends a
            heartbeat at once).
    """

    def __init__(
        self,
        topics: Topics,
        worker_id: str,
        stats: WorkerStats,
        clock: Clock,
        control_topic: str,
        *,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.topics = topics
        self.worker_id = worker_id
        self.stats = stats
        self.clock = clock
        self.control_topic = control_topic
        self.on_change = on_change or (lambda: None)
        self.follower = DocumentFollower(topics)
        self.pipelines: dict[str, _Pipeline] = {}
        self._handlers: dict[int, BatchHandler] = {}  # subscription id -> handler (+ retiring)
        self._retiring: dict[str, int] = {}  # marker token -> subscription id
        self._pending: set[str] = set()  # recorded, SUBSCRIBE not granted yet
        self._ids = itertools.cycle(range(1, MAX_SUBSCRIPTION_ID + 1))

    async def join(self, session: Session) -> None:
        """Subscribe every served pipeline again (new identifiers), then follow the documents.

        A new session starts clean: nothing queued under the old identifiers can arrive.
        """
        self._handlers.clear()
        self._retiring.clear()
        self._pending.clear()
        for name, served in list(self.pipelines.items()):
            sid = next(self._ids)
            await session.subscribe(served.filters, qos=1, subscription_id=sid)
            self._handlers[sid] = served.handler
            self.pipelines[name] = replace(served, sid=sid)
        await session.subscribe([self.topics.pipeline_documents()], qos=1)

    async def leave(self, session: Session) -> None:
        """Stop following documents and leave every pipeline's group (draining)."""
        await session.unsubscribe([self.topics.pipeline_documents()])
        filters = sorted({f for served in self.pipelines.values() for f in served.filters})
        if filters:
            await session.unsubscribe(filters)

    async def route(self, session: Session, message: Message) -> list[asyncio.Future[None]]:
        """A batch to the handlers its subscription identifiers name; a document applied."""
        handlers = [self._handlers[i] for i in message.subscription_ids if i in self._handlers]
        if handlers:
            return [f for h in handlers for f in h.handle(session, message)]
        if self.follower.is_document(message.topic):
            change = self.follower.take(message)
            if isinstance(change, Served):
                await self._serve(session, change)
            elif isinstance(change, Dropped):
                await self._drop(session, change.name)
            if change is not None:
                self.on_change()
            return []
        self.stats.counters.unrouted += 1
        log.warning(
            "worker %s: no served pipeline for %s (subscription ids %s); acknowledged",
            self.worker_id,
            message.topic,
            list(message.subscription_ids),
        )
        return []

    async def _serve(self, session: Session, change: Served) -> None:
        handler = BatchHandler(change.spec, self.topics, self.worker_id, self.stats, self.clock)
        sid = next(self._ids)
        old = self.pipelines.get(change.name)
        # Recorded before the SUBSCRIBE: should the connection fail meanwhile, `join` on the
        # next one subscribes it (the document will not come back as a change). Not listed
        # in `serving` until the broker granted it.
        self.pipelines[change.name] = _Pipeline(change.version, handler, sid)
        self._handlers[sid] = handler
        self._pending.add(change.name)
        await session.subscribe(handler.filters, qos=1, subscription_id=sid)
        self._pending.discard(change.name)
        log.info("worker %s: serving %s v%d", self.worker_id, change.name, change.version)
        if old is not None:
            gone = [f for f in old.filters if f not in handler.filters]
            if gone:
                await session.unsubscribe(gone)
            await self._retire(session, old.sid)

    async def _drop(self, session: Session, name: str) -> None:
        old = self.pipelines.pop(name, None)
        self._pending.discard(name)
        if old is None:
            return
        await session.unsubscribe(old.filters)
        await self._retire(session, old.sid)
        log.info("worker %s: no longer serving %s", self.worker_id, name)

    async def _retire(self, session: Session, sid: int) -> None:
        token = os.urandom(8).hex()
        self._retiring[token] = sid
        marker = Marker.on(self.control_topic, token)
        await session.publish(marker.topic, marker.payload, qos=1)

    def marker_back(self, token: str) -> bool:
        """A retire marker is back: nothing more can arrive under its identifier."""
        sid = self._retiring.pop(token, None)
        if sid is None:
            return False
        self._handlers.pop(sid, None)
        return True

    def describe(self) -> dict[str, object]:
        """A pool worker names no single pipeline; ``serving`` maps each to its version."""
        serving = {
            name: served.version
            for name, served in sorted(self.pipelines.items())
            if name not in self._pending
        }
        return {"pipeline": None, "serving": serving}
