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
* **update** (a new version): build the new handler and SUBSCRIBE the inputs of every version
  still computed with a new identifier (the same filter again replaces the subscription),
  then *retire* the old identifier. The old version's handler is kept: from then on each
  batch is computed with both versions (each partial names its spec's fingerprint), because
  the combiners finish the windows before the update's cut under the old version
  (``shoal.processors.versions``). It is dropped once every partition of the pipeline is
  announced by the pool combiners (``shoal/combiners/+``) without that version among the
  ones it still computes (``Owned.open``); then the inputs only it read are UNSUBSCRIBEd.
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
from shoal.control.assignment import Announcement
from shoal.control.follower import DocumentFollower, Dropped, Served
from shoal.control.messages import Marker
from shoal.errors import ControlError
from shoal.runtime._batches import BatchHandler, WorkerStats
from shoal.runtime._shared_work import SharedWork
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Pipeline:
    """One served pipeline: its current version, handler and subscription id.

    ``older``: (version, handler) of older versions whose windows combiners still compute.
    """

    version: int
    handler: BatchHandler
    sid: int
    older: tuple[tuple[int, BatchHandler], ...] = ()

    @property
    def handlers(self) -> list[BatchHandler]:
        """Every version's handler, newest first."""
        return [self.handler, *(h for _, h in self.older)]

    @property
    def filters(self) -> tuple[str, ...]:
        """The shared subscriptions of every version's inputs."""
        return tuple(dict.fromkeys(f for h in self.handlers for f in h.filters))


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
        self._handlers: dict[int, list[BatchHandler]] = {}  # subscription id -> handlers
        self._combiners: dict[str, Announcement] = {}  # pool combiners, by member id
        self._retiring: dict[str, int] = {}  # marker token -> subscription id
        self._pending: set[str] = set()  # recorded, SUBSCRIBE not granted yet
        self._ids = itertools.cycle(range(1, MAX_SUBSCRIPTION_ID + 1))
        self.shared = SharedWork(clock.monotonic)
        """Copies of one batch for several pipelines: decoded once, partials made once per
        fingerprint (``shoal.runtime._shared_work``)."""

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
            self._handlers[sid] = served.handlers
            self.pipelines[name] = replace(served, sid=sid)
        await session.subscribe(
            [self.topics.pipeline_documents(), self.topics.pool_combiners()], qos=1
        )

    async def leave(self, session: Session) -> None:
        """Stop following documents and leave every pipeline's group (draining)."""
        await session.unsubscribe([self.topics.pipeline_documents(), self.topics.pool_combiners()])
        filters = sorted({f for served in self.pipelines.values() for f in served.filters})
        if filters:
            await session.unsubscribe(filters)

    async def route(
        self, session: Session, message: Message, out: Session
    ) -> list[asyncio.Future[None]]:
        """A batch to the handlers its subscription identifiers name; a document applied.

        Partials go out on ``out``; subscriptions change on ``session``.
        """
        handlers = [h for i in message.subscription_ids for h in self._handlers.get(i, ())]
        if len(handlers) > 1:  # versions of one pipeline may read different inputs
            handlers = [h for h in handlers if h.reads(message.topic)]
        if handlers:
            return [f for h in handlers for f in h.handle(out, message)]
        if topic_matches(self.topics.pool_combiners(), message.topic):
            await self._on_announcement(session, message)
            return []
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
        old = self.pipelines.get(change.name)
        if old is not None and old.handler.spec == change.spec:
            # A new version of the document, not of the spec (released, or a name back).
            self.pipelines[change.name] = replace(old, version=change.version)
            return
        handler = BatchHandler(
            change.spec, self.topics, self.worker_id, self.stats, self.clock, self.shared
        )
        sid = next(self._ids)
        older = () if old is None else ((old.version, old.handler), *old.older)
        served = _Pipeline(change.version, handler, sid, older)
        # Recorded before the SUBSCRIBE: should the connection fail meanwhile, `join` on the
        # next one subscribes it (the document will not come back as a change). Not listed
        # in `serving` until the broker granted it.
        self.pipelines[change.name] = served
        self._handlers[sid] = served.handlers
        self._pending.add(change.name)
        await session.subscribe(served.filters, qos=1, subscription_id=sid)
        self._pending.discard(change.name)
        log.info("worker %s: serving %s v%d", self.worker_id, change.name, change.version)
        if old is not None:
            await self._retire(session, old.sid)
            await self._prune(session, change.name)

    async def _on_announcement(self, session: Session, message: Message) -> None:
        """A pool combiner's presence: older versions no partition computes are dropped."""
        member = message.topic.rsplit("/", 1)[-1]
        try:
            self._combiners[member] = Announcement.from_json(message.payload)
        except ControlError:
            self._combiners.pop(member, None)  # gone (cleared), or not an announcement
        for name in [n for n, p in self.pipelines.items() if p.older]:
            await self._prune(session, name)

    async def _prune(self, session: Session, name: str) -> None:
        """Drop the older versions of ``name`` that no partition still computes.

        Only once every partition of the current version is announced: a partition without
        an owner right now may be restored with an older version still open.
        """
        served = self.pipelines[name]
        oldest: dict[int, int] = {}
        for announcement in self._combiners.values():
            for owned in announcement.owns:
                if owned.pipeline == name and owned.version >= served.version:
                    oldest[owned.partition] = owned.oldest
        if len(oldest) < served.handler.spec.partitions:
            return
        floor = min(oldest.values())
        kept = tuple((v, h) for v, h in served.older if v >= floor)
        if kept == served.older:
            return
        pruned = replace(served, older=kept)
        self.pipelines[name] = pruned
        self._handlers[served.sid] = pruned.handlers
        gone = [f for f in served.filters if f not in pruned.filters]
        if gone:
            await session.unsubscribe(gone)
        log.info(
            "worker %s: %s: no partition computes v%s any more",
            self.worker_id,
            name,
            ", v".join(str(v) for v, _ in served.older if v < floor),
        )
        self.on_change()

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
