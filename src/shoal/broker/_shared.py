"""What the session implementations share: the size and identifier checks, and ``SessionBase``.

No third-party imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, TypeVar

from shoal._futures import ignore_outcome
from shoal.broker.session import MAX_SUBSCRIPTION_ID, PROTOCOL_OVERHEAD, Message, Session
from shoal.errors import BrokerError, PayloadTooLargeError

REPLY_QUIET_S: Final = 10.0
"""A SUBSCRIBE or UNSUBSCRIBE fails when its reply has not come and nothing else arrived for
this long. MQTT keeps a connection's packets in order and a broker sends a returning
persistent session its queued messages before it answers, so a fixed timeout would fail a
healthy connection whenever reading them takes longer."""

SUBSCRIBE_ATTEMPTS: Final = 3
"""SUBSCRIBEs sent while the broker answers only "Packet Identifier in use" (0x91)."""

PACKET_ID_IN_USE: Final = 0x91

T = TypeVar("T")


def only_packet_id_in_use(codes: Sequence[int]) -> bool:
    """Whether every failed reason code (0x80 and up) is "Packet Identifier in use": try again.

    Mochi MQTT 2.7.9 checks a SUBSCRIBE's packet identifier against the messages it holds
    *for* the client, so a resumed session with queued messages refuses a SUBSCRIBE whose
    identifier one of them carries (identifiers are per direction in MQTT; docs/brokers.md).
    """
    failed = [c for c in codes if c >= 0x80]
    return bool(failed) and all(c == PACKET_ID_IN_USE for c in failed)


async def reply_while_receiving(
    reply: asyncio.Future[T],
    received: Callable[[], int],
    what: str,
    lost: asyncio.Future[Any] | None = None,
) -> T:
    """The reply to a SUBSCRIBE or UNSUBSCRIBE, waited for while messages keep coming.

    MQTT keeps a connection's packets in order, so a SUBACK comes after every message the
    broker had queued for us before it: a persistent session that returns to a backlog gets
    up to its Receive Maximum of messages first. A fixed timeout would then fail a healthy
    connection whenever the machine is slow (aiomqtt's 10 s did: the adapter reconnected,
    got the same backlog and never got anywhere). So the wait fails only when ``received()``
    (messages so far) did not move for ``REPLY_QUIET_S``, or ``lost`` completes.

    Raises:
        BrokerError: the connection was lost or went quiet (a failed ``reply`` raises its own).
    """
    waiting: set[asyncio.Future[Any]] = {reply} if lost is None else {reply, lost}
    while True:
        seen = received()
        done, _ = await asyncio.wait(
            waiting, timeout=REPLY_QUIET_S, return_when=asyncio.FIRST_COMPLETED
        )
        if reply in done:
            return reply.result()
        if lost is not None and lost in done:
            raise BrokerError(f"{what} failed: the connection was lost")
        if received() == seen:
            raise BrokerError(f"{what} failed: no reply and no message for {REPLY_QUIET_S} s")


def check_size(topic: str, payload: bytes, limit: int | None) -> None:
    """Refuse a message the broker would refuse (paho would reconnect and resend it forever).

    Raises:
        PayloadTooLargeError: it does not fit in ``limit`` bytes with the protocol overhead.
    """
    if limit is not None and len(payload) + len(topic) + PROTOCOL_OVERHEAD > limit:
        raise PayloadTooLargeError(
            f"message for {topic!r} is {len(payload)} bytes; the broker accepts packets of at "
            f"most {limit} bytes. It was not sent: split it or raise the broker's max_packet_size."
        )


def check_sizes(messages: Sequence[tuple[str, bytes]], head: bytes, limit: int | None) -> None:
    """``check_size`` for each (topic, ``head`` + payload) of ``messages``.

    Raises:
        PayloadTooLargeError: one does not fit in ``limit`` bytes with the protocol overhead.
    """
    if limit is None:
        return
    room = limit - PROTOCOL_OVERHEAD - len(head)
    for topic, payload in messages:
        if len(payload) + len(topic) > room:
            check_size(topic, head + payload, limit)  # raises, with the message


def check_column_sizes(
    topics: Sequence[str], payloads: Sequence[bytes], head: bytes, limit: int | None
) -> None:
    """``check_sizes`` of ``zip(topics, payloads)``: the largest first, in C, then find it.

    Raises:
        PayloadTooLargeError: one does not fit in ``limit`` bytes with the protocol overhead.
    """
    if limit is None or not topics:
        return
    room = limit - PROTOCOL_OVERHEAD - len(head)
    if max(map(operator.add, map(len, topics), map(len, payloads))) > room:
        check_sizes(list(zip(topics, payloads, strict=True)), head, limit)


def check_subscription_id(subscription_id: int | None) -> None:
    """Refuse a Subscription Identifier MQTT 5 cannot carry (the broker would disconnect us).

    Raises:
        BrokerError: not None and not in 1..``MAX_SUBSCRIPTION_ID``.
    """
    if subscription_id is not None and not 1 <= subscription_id <= MAX_SUBSCRIPTION_ID:
        raise BrokerError(
            f"subscription identifier {subscription_id} is outside 1..{MAX_SUBSCRIPTION_ID}"
        )


class SessionBase(Session):
    """The part of a ``Session`` that follows from ``publish_started`` and ``messages``.

    Implementations subclass it (and so declare that they are a ``Session``); they set
    ``_publish_timeout_s``.
    """

    _publish_timeout_s: float

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
        user_properties: Sequence[tuple[str, str]] | None = None,
        message_expiry_s: int | None = None,
    ) -> None:
        """Publish and, for QoS 1, wait until the broker has accepted it (PUBACK).

        Raises:
            PayloadTooLargeError: larger than the broker's maximum packet size; not sent.
            BrokerError: refused, disconnected, or no PUBACK within the timeout.
        """
        fut = self.publish_started(
            topic,
            payload,
            qos=qos,
            retain=retain,
            content_type=content_type,
            user_properties=user_properties,
            message_expiry_s=message_expiry_s,
        )
        with self._answer_awaited():
            await self.wait_published([fut])

    def publish_many(
        self, messages: Sequence[tuple[str, bytes]], *, retain: bool = False, head: bytes = b""
    ) -> None:
        """Hand QoS 0 messages (topic, payload) to the connection now, in order.

        As two columns (``publish_columns``), which each session implements.

        Raises:
            PayloadTooLargeError: one is larger than the broker's maximum packet size; none
                was sent.
            BrokerError: not connected.
        """
        if messages:
            topics, payloads = zip(*messages, strict=True)
            self.publish_columns(topics, payloads, retain=retain, head=head)

    def publish_columns(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        *,
        retain: bool = False,
        head: bytes = b"",
    ) -> None:
        """``publish_many`` of ``zip(topics, payloads)`` (``Session.publish_columns``).

        Here one ``publish_started`` each; ``BatchedSession`` writes them at once.

        Raises:
            PayloadTooLargeError: one is larger than the broker's maximum packet size; none
                was sent.
            BrokerError: not connected.
        """
        check_column_sizes(topics, payloads, head, self.max_packet_size)
        for topic, payload in zip(topics, payloads, strict=True):
            sent = self.publish_started(topic, head + payload, qos=0, retain=retain)
            if not sent.done():  # held (``HeldSession``): its outcome comes later
                sent.add_done_callback(ignore_outcome)
            elif (error := sent.exception()) is not None:
                raise error  # the connection is gone: the rest would fail alike

    def _answer_awaited(self) -> contextlib.AbstractContextManager[None]:
        """Around waiting in line for an answer (a session whose reading may pause reads on)."""
        return contextlib.nullcontext()

    async def wait_published(self, futures: Sequence[asyncio.Future[None]]) -> None:
        """Wait for PUBACKs of publishes started with ``publish_started``.

        Raises:
            BrokerError: one failed, or they were not all acknowledged within the timeout.
        """
        if not futures:
            return
        try:
            async with asyncio.timeout(self._publish_timeout_s):
                await asyncio.gather(*futures)
        except TimeoutError as exc:
            raise BrokerError(f"no PUBACK within {self._publish_timeout_s} s") from exc

    def messages_until(self, stop: asyncio.Event) -> AsyncIterator[Message]:
        """Received messages until ``stop`` is set (then it simply ends).

        Raises:
            BrokerError: the connection was lost first.
        """
        return _until_stopped(self.messages(), stop)

    async def message_batches(self, stop: asyncio.Event) -> AsyncIterator[list[Message]]:
        """Received messages until ``stop`` is set, one per batch (``BatchedSession`` batches).

        Raises:
            BrokerError: the connection was lost first.
        """
        async for message in self.messages_until(stop):
            yield [message]

    def ack_many(self, messages: Sequence[Message]) -> None:
        """``ack`` each of ``messages``, in order."""
        for message in messages:
            self.ack(message)


async def _until_stopped(
    messages: AsyncIterator[Message], stop: asyncio.Event
) -> AsyncIterator[Message]:
    """``messages`` until ``stop`` is set, then it ends (a receive still pending is cancelled)."""
    iterator = messages.__aiter__()
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if nxt in done:
                yield nxt.result()
                continue
            nxt.cancel()
            # asyncio.wait, not `await nxt` under suppress(CancelledError): a cancellation of
            # *this* task while the receive winds down must propagate, not end the loop as if
            # stopped (a component would then carry on, e.g. reconnect, instead of dying).
            await asyncio.wait({nxt})
            if not nxt.cancelled():
                nxt.exception()  # retrieved: a lost connection at stop time is no failure
            return
    finally:
        stopper.cancel()
