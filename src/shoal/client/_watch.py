"""One subscription to a pipeline's results, and what it learns about the pipeline.

A ``Watch`` owns an ``Session`` subscribed to the pipeline's window results (and, where the
broker's ACL allows, combiner heartbeats and retained confirmations, which tell whether the
pipeline exists and how far each partition has closed). It turns messages into assembled
windows, per-key records and evidence that the pipeline exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from shoal.broker.session import Message, Session
from shoal.client.assemble import AssembledWindow, WindowAssembler
from shoal.client.errors import NoSuchPipelineError
from shoal.client.messages import parse_key_message
from shoal.clock import Clock, SystemClock
from shoal.errors import BrokerError, SchemaError
from shoal.schemas.results import parse_window_message
from shoal.schemas.topics import Topics

log = logging.getLogger(__name__)


class Watch:
    """Results and pipeline evidence from one session (see the module docstring).

    Args:
        session: an open session.
        topics: the deployment's topic namespace.
        pipeline: the pipeline to watch.
        assembler: joins partitions and drops duplicates.
        per_key: subscribe to the retained per-key results instead of window messages.
        clock: when retained messages last arrived is read from it (the client's clock).
    """

    def __init__(
        self,
        session: Session,
        topics: Topics,
        pipeline: str,
        assembler: WindowAssembler,
        *,
        per_key: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.session = session
        self.clock = clock or SystemClock()
        self.topics = topics
        self.pipeline = pipeline
        self.assembler = assembler
        self.per_key = per_key
        self.exists = False
        self.can_discover = False
        self.known: set[str] = set()
        self.key_records: dict[str, dict[str, Any]] = {}
        self.last_retained_at: float | None = None
        self._confirms = False
        self._results = topics.results(pipeline)
        self._keys_prefix = topics.results(pipeline) + "/"
        self._reserved = {topics.results_encoded(pipeline, "msgpack")}
        self._metrics_prefix = topics.metrics("combiner", "")
        self._confirm_prefix = topics.confirm_all()[:-1]

    async def subscribe(self) -> None:
        """Subscribe to results, then (if permitted) to heartbeats and confirmations."""
        main = self.topics.result_keys(self.pipeline) if self.per_key else self._results
        await self.session.subscribe([main], qos=1)
        found = 0
        for topic_filter in (
            self.topics.metrics("combiner", "+"),
            self.topics.confirm_all(),
        ):
            try:
                await self.session.subscribe([topic_filter], qos=0)
                found += 1
            except BrokerError as exc:  # an ACL that lets us read results only
                log.info("results client: cannot read %s (%s)", topic_filter, exc)
        self.can_discover = found == 2
        self._confirms = found == 2

    async def discovered(self) -> None:
        """Once the pipeline is known to exist, stop receiving every gateway's confirmations."""
        if self.exists and self._confirms:
            self._confirms = False
            await self.session.unsubscribe([self.topics.confirm_all()])

    def on_message(self, message: Message, now_ms: int) -> list[AssembledWindow]:
        """Take one message; return the windows it completed."""
        topic = message.topic
        if topic == self._results:
            return self._on_window(message, now_ms)
        if topic.startswith(self._metrics_prefix):
            return self._on_heartbeat(message, now_ms)
        if topic.startswith(self._confirm_prefix):
            self._on_confirm(message)
        elif topic.startswith(self._keys_prefix) and topic not in self._reserved:
            self._on_key(message)
        return []

    def _on_window(self, message: Message, now_ms: int) -> list[AssembledWindow]:
        self.exists = True
        try:
            parsed = parse_window_message(message.payload, message.content_type)
        except SchemaError as exc:
            log.warning("results client: skipping a bad message on %s: %s", message.topic, exc)
            return []
        return self.assembler.add(parsed, now_ms)

    def _on_heartbeat(self, message: Message, now_ms: int) -> list[AssembledWindow]:
        body = _json(message.payload)
        pipeline = body.get("pipeline")
        if not isinstance(pipeline, str):
            return []
        self.known.add(pipeline)
        if pipeline != self.pipeline:
            return []
        self.exists = True
        partition, closed = body.get("partition"), body.get("closed_through")
        if type(partition) is not int or not (closed is None or type(closed) is int):
            return []
        return self.assembler.note_progress(pipeline, partition, closed, now_ms)

    def _on_confirm(self, message: Message) -> None:
        pipeline = _json(message.payload).get("pipeline")
        if isinstance(pipeline, str):
            self.known.add(pipeline)
            self.exists = self.exists or pipeline == self.pipeline

    def _on_key(self, message: Message) -> None:
        try:
            record = parse_key_message(message.payload)
        except SchemaError:
            return
        self.exists = True
        if message.retain:
            self.last_retained_at = self.clock.monotonic()
        key = record.get("key")
        self.key_records["" if key is None else str(key)] = record

    def missing(self, where: str, waited_s: float) -> NoSuchPipelineError:
        """The error to raise when discovery found no trace of the pipeline."""
        return NoSuchPipelineError(self.pipeline, sorted(self.known), where, waited_s)


def _json(payload: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(payload) if payload else {}
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


async def messages_with_ticks(session: Session, tick_s: float) -> AsyncIterator[Message | None]:
    """The session's messages, with ``None`` every ``tick_s`` seconds without one.

    Waiting never cancels a pending receive (cancelling it would end the session's iterator).

    Raises:
        BrokerError: the connection was lost.
    """
    iterator = session.messages().__aiter__()
    pending: asyncio.Future[Message] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=tick_s)
            if not done:
                yield None
                continue
            message = pending.result()
            pending = None
            yield message
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, BrokerError, StopAsyncIteration):
                await pending
