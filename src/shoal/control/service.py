"""The control-plane service (``shoal control``): answers pipeline requests, keeps the registry.

Lifecycle, in this order (one instance per deployment):

1. connect; subscribe to every pipeline document (``shoal/pipelines/+``, retained), to the
   requests (``shoal/pipelines/_request/+``) and to its own control topic;
2. publish a marker to its own control topic; every retained document arrives before it
   (the broker sends retained messages at SUBSCRIBE, ahead of anything published later on
   the same connection), so when the marker comes back the registry is restored;
   requests that arrived meanwhile wait in order; ``ready`` is set;
3. for each request, in arrival order: decide (``Registry.decide``); if accepted, publish
   the document retained (QoS 1) and wait for the PUBACK, then commit; then publish the
   result on ``shoal/pipelines/_reply/<client>``. A crash between the two leaves the
   document stored and the client without an answer: it times out, and the same request
   again is answered ``unchanged``.

Nothing is silent: unreadable requests are answered (``invalid_json``/``invalid_request``)
and counted; a message on a request topic with no client segment and unreadable retained
documents are counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from shoal.broker.session import Message, Session, SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock
from shoal.control.follower import DocumentFollower
from shoal.control.messages import Marker, PipelineDocument, Request, Result
from shoal.control.registry import Registry, refuse_unreadable
from shoal.errors import ControlError
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ControlCounters:
    """What the service has done since it started.

    Attributes:
        restored: pipeline documents read back at start (tombstones included).
        invalid_documents: retained documents that could not be restored.
        accepted: requests accepted.
        refused: requests refused (unreadable ones included).
        unanswerable: messages on request topics without a client to answer.
    """

    restored: int = 0
    invalid_documents: int = 0
    accepted: int = 0
    refused: int = 0
    unanswerable: int = 0

    @property
    def requests(self) -> int:
        """Requests answered, accepted or refused."""
        return self.accepted + self.refused


class ControlPlane:
    """Serves pipeline requests over one MQTT session until stopped (see module docstring)."""

    def __init__(
        self,
        settings: BrokerSettings,
        topics: Topics,
        clock: Clock,
        *,
        session_factory: SessionFactory | None = None,
        instance: str | None = None,
    ) -> None:
        """Configure; nothing connects until ``run``.

        Args:
            settings: the broker.
            topics: the deployment's topic root.
            clock: stamps documents (``changed_at_ms``).
            session_factory: the ``Session`` implementation (default: ``AsyncSession``).
            instance: client id (default: a unique ``shoal-control-...``).
        """
        if session_factory is None:
            from shoal.broker import default_session_factory  # noqa: PLC0415 - lazy seam

            session_factory = default_session_factory()
        self.settings = settings
        self.topics = topics
        self.clock = clock
        self.session_factory = session_factory
        self.instance = instance or unique_client_id("shoal-control")
        self.registry = Registry()
        self._follower = DocumentFollower(topics, self.registry)
        self.counters = ControlCounters()
        self.ready = asyncio.Event()
        self._marker = Marker.on(topics.control(self.instance), os.urandom(8).hex())

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, restore, and answer requests until ``stop`` is set.

        Raises:
            BrokerError: the broker cannot be reached or the connection is lost.
        """
        session = self.session_factory(self.settings, self.instance)
        async with session:
            await session.subscribe(
                [
                    self.topics.pipeline_documents(),
                    self.topics.pipeline_requests(),
                    self._marker.topic,
                ],
                qos=1,
            )
            await session.publish(self._marker.topic, self._marker.payload, qos=1)
            waiting: list[Message] = []
            async for message in session.messages_until(stop):
                if not self.ready.is_set():
                    self._restoring(message, waiting)
                    if self.ready.is_set():
                        await session.unsubscribe([self.topics.pipeline_documents()])
                        for early in waiting:
                            await self._answer(session, early)
                        waiting.clear()
                elif topic_matches(self.topics.pipeline_requests(), message.topic):
                    await self._answer(session, message)

    def _restoring(self, message: Message, waiting: list[Message]) -> None:
        if self._marker.is_back(message.topic, message.payload):
            log.info(
                "control plane ready: %d pipeline(s) deployed, %d document(s) restored",
                len(self.registry),
                self.counters.restored,
            )
            self.ready.set()
        elif topic_matches(self.topics.pipeline_requests(), message.topic):
            waiting.append(message)
        elif self._follower.is_document(message.topic) and message.payload:
            self._restore(message)

    def _restore(self, message: Message) -> None:
        invalid = self._follower.invalid
        self._follower.take(message)  # validates it into self.registry, or counts and logs
        if self._follower.invalid > invalid:
            self.counters.invalid_documents += 1
        else:
            self.counters.restored += 1

    async def _answer(self, session: Session, message: Message) -> None:
        client = message.topic.rsplit("/", 1)[-1]
        if not client or message.topic != self.topics.pipeline_request(client):
            self.counters.unanswerable += 1
            log.error("control request on %s has no client to answer", message.topic)
            return
        result = await self.handle(session, message.payload)
        if result.ok:
            self.counters.accepted += 1
        else:
            self.counters.refused += 1
        log.info("%s: %s", client, result.message)
        await session.publish(self.topics.pipeline_reply(client), result.to_json(), qos=1)

    async def handle(self, session: Session, payload: bytes) -> Result:
        """Decide one request and, if accepted, store its document before answering."""
        try:
            request = Request.from_json(payload)
        except ControlError as exc:
            return refuse_unreadable(exc)
        now = self.clock.now_ms()
        result, document = self.registry.decide(request, now)
        if document is not None:
            previous = self.registry.get(document.name)
            await self._store(session, document)
            for follow_up in self.registry.follow_ups(previous, now):
                await self._store(session, follow_up)
        return result

    async def _store(self, session: Session, document: PipelineDocument) -> None:
        """Retain a document (QoS 1, PUBACK awaited), then commit it to the registry."""
        await session.publish(
            self.topics.pipeline_document(document.name), document.to_json(), qos=1, retain=True
        )
        self.registry.commit(document)


async def serve(plane: ControlPlane, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
    """Run ``plane`` until ``stop``, calling ``on_ready`` once it has restored its state."""
    task = asyncio.create_task(plane.run(stop))
    ready = asyncio.create_task(plane.ready.wait())
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        on_ready()
    else:
        ready.cancel()
    await task
