"""Publishes held behind local writes: a ``Session`` whose messages wait for barriers.

``HeldSession`` wraps a session for a component that must not publish what a local write
decides before that write is done (the combiner's close log, docs/guarantees.md "Restarts:
the close log"), without waiting for the write on its event loop. The component calls
``hold_until(done)`` with the future of each write it starts; every publish started after
that is handed to the connection only once ``done`` (and so every earlier barrier: the
writes complete in the order they were started) has completed, in the order the publishes
were started. With no write pending a publish goes straight through, and a message the
broker could never take is refused at once (``PayloadTooLargeError``), held or not.

A barrier that fails breaks the session: the held publishes fail with its error and so does
every later one; nothing decided after a failed write is ever published.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from shoal.broker._shared import SessionBase, check_column_sizes, check_size
from shoal.broker.session import Message, Session


@dataclass(slots=True)
class _Held:
    after: int
    """The barrier it waits for (their numbers increase in the order they complete)."""
    topic: str
    payload: bytes
    options: dict[str, Any]
    outer: asyncio.Future[None]


@dataclass(slots=True)
class _HeldMany:
    """QoS 0 messages of one ``publish_many``, held as one: handed over in one call."""

    after: int
    topics: Sequence[str]
    payloads: Sequence[bytes]
    retain: bool
    head: bytes


class HeldSession(SessionBase):
    """``inner`` with its publishes held behind barriers (see the module docstring)."""

    def __init__(self, inner: Session) -> None:
        """Wrap an open session; subscribing and receiving go to it unchanged."""
        self.inner = inner
        self.settings = inner.settings
        self.client_id = inner.client_id
        self._last: asyncio.Future[None] | None = None
        self._barriers = 0
        """Barriers given so far (the last one's number)."""
        self._released_through = 0
        """The last barrier whose completion was looked at (all before it were too)."""
        self._held: deque[_Held | _HeldMany] = deque()
        self._failure: BaseException | None = None
        self.held_total = 0
        """Publishes that had to wait for a barrier (a count for tests and profiles)."""

    def hold_until(self, done: asyncio.Future[None]) -> None:
        """Publishes started from now on wait for ``done``.

        ``done``: a write started after the last one given, by the same writer (they
        complete in order).
        """
        if self._failure is not None or done is self._last:
            return
        self._last = done
        self._barriers += 1
        done.add_done_callback(functools.partial(self._released, self._barriers))

    def publish_started(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
        user_properties: Sequence[tuple[str, str]] | None = None,
        message_expiry_s: int | None = None,
    ) -> asyncio.Future[None]:
        """Hand the message over now, or once the writes started before it are done.

        Raises:
            PayloadTooLargeError: larger than the broker's maximum packet size; not sent.
        """
        if self._failure is None and not self._held and self._released_through == self._barriers:
            return self.inner.publish_started(
                topic,
                payload,
                qos=qos,
                retain=retain,
                content_type=content_type,
                user_properties=user_properties,
                message_expiry_s=message_expiry_s,
            )
        options: dict[str, Any] = {
            "qos": qos,
            "retain": retain,
            "content_type": content_type,
            "user_properties": user_properties,
            "message_expiry_s": message_expiry_s,
        }
        check_size(topic, payload, self.inner.max_packet_size)
        outer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            outer.set_exception(self._failure)
            return outer
        self._held.append(_Held(self._barriers, topic, payload, options, outer))
        self.held_total += 1
        return outer

    def publish_columns(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        *,
        retain: bool = False,
        head: bytes = b"",
    ) -> None:
        """QoS 0 messages over now (at once), or once the writes started before are done.

        Held, they are kept as given (not copied): the caller hands them over and leaves them.

        Raises:
            PayloadTooLargeError: one is larger than the broker's maximum packet size; none
                was sent.
            BrokerError: not connected, or a barrier failed.
        """
        if self._failure is None and not self._held and self._released_through == self._barriers:
            self.inner.publish_columns(topics, payloads, retain=retain, head=head)
            return
        # Held as one: a future, a packet and a write per message (``SessionBase``'s way)
        # cost a sliding combiner of 100,000 keys 3-4 % of its main thread, its per-key
        # results being held behind a close-log write at most steps.
        check_column_sizes(topics, payloads, head, self.inner.max_packet_size)
        if self._failure is not None:
            raise self._failure
        self._held.append(_HeldMany(self._barriers, topics, payloads, retain, head))
        self.held_total += len(topics)

    def _released(self, barrier: int, done: asyncio.Future[None]) -> None:
        """Barrier number ``barrier`` completed: hand over what waited for it, or fail all.

        What waited for it or an earlier barrier goes to the connection, in order; if it
        failed, everything held fails with its error. The writes complete in the order
        they were started (one writer), and so run these callbacks: a failure is seen
        before any later barrier releases anything.
        """
        self._released_through = max(self._released_through, barrier)
        if self._failure is None:
            self._failure = (
                OSError("a write that publishes wait for was cancelled")
                if done.cancelled()
                else done.exception()
            )
        while self._failure is None and self._held and self._held[0].after <= barrier:
            held = self._held.popleft()
            if isinstance(held, _HeldMany):
                # QoS 0, no outcome to hand back: a lost connection fails what follows too
                with contextlib.suppress(Exception):
                    self.inner.publish_columns(
                        held.topics, held.payloads, retain=held.retain, head=held.head
                    )
                continue
            try:
                inner = self.inner.publish_started(held.topic, held.payload, **held.options)
            except Exception as exc:  # noqa: BLE001 - the caller learns it from the future
                held.outer.set_exception(exc)
                continue
            inner.add_done_callback(functools.partial(_copy, outer=held.outer))
        if self._failure is not None:
            while self._held:
                held = self._held.popleft()
                if isinstance(held, _Held) and not held.outer.done():
                    held.outer.set_exception(self._failure)

    async def wait_published(self, futures: Sequence[asyncio.Future[None]]) -> None:
        """Wait for the writes they were held behind (however long), then for their PUBACKs.

        Raises:
            BrokerError: one failed, or they were not acknowledged within the session's
                timeout once handed over.
            OSError: the write they waited for failed.
        """
        if not futures:
            return
        last = self._last
        if last is not None and not last.done():
            await asyncio.wait({last})
        await self.inner.wait_published(futures)

    # -- the rest goes to the wrapped session --------------------------------------------------

    async def __aenter__(self) -> Self:
        """The wrapped session is opened by its owner: nothing to do."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """The wrapped session is closed by its owner: nothing to do."""

    @property
    def max_packet_size(self) -> int | None:
        """The wrapped session's."""
        return self.inner.max_packet_size

    async def subscribe(
        self,
        filters: Sequence[str],
        qos: int = 1,
        *,
        no_local: bool = False,
        subscription_id: int | None = None,
    ) -> None:
        """Subscribe on the wrapped session."""
        await self.inner.subscribe(filters, qos, no_local=no_local, subscription_id=subscription_id)

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Unsubscribe on the wrapped session."""
        await self.inner.unsubscribe(filters)

    def ack(self, message: Message) -> None:
        """Acknowledge on the wrapped session."""
        self.inner.ack(message)

    def ack_many(self, messages: Sequence[Message]) -> None:
        """Acknowledge on the wrapped session."""
        self.inner.ack_many(messages)

    def messages(self) -> AsyncIterator[Message]:
        """The wrapped session's messages."""
        return self.inner.messages()


def _copy(inner: asyncio.Future[None], *, outer: asyncio.Future[None]) -> None:
    if outer.done():
        return
    if inner.cancelled():
        outer.cancel()
    elif (exc := inner.exception()) is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(None)
