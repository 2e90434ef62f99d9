"""The ``Session`` of ``shoal.broker.memory``: what a client of the in-memory broker holds."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Protocol, Self

from shoal.broker._shared import SessionBase, check_size, check_subscription_id
from shoal.broker.session import Message, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError


@dataclass(slots=True)
class ClientState:
    """What a ``MemoryBroker`` keeps of a client.

    Attributes:
        subscriptions: topic filter → (QoS, no_local, subscription identifier or None).
        queue: messages not yet handed to the client.
        inflight: messages handed over and not acknowledged yet, by packet id.
        session: the live session, if connected.
    """

    subscriptions: dict[str, tuple[int, bool, int | None]] = field(default_factory=dict)
    queue: deque[Message] = field(default_factory=deque)
    inflight: dict[int, Message] = field(default_factory=dict)
    session: MemorySession | None = None


class Router(Protocol):
    """What a ``MemorySession`` needs from its broker (``shoal.broker.memory.MemoryBroker``).

    A Protocol rather than an import: the broker module imports this one.
    """

    max_packet_size: int | None

    def attach(self, session: MemorySession) -> ClientState:
        """Connect ``session``; its client's state (resumed or new)."""
        ...

    def detach(self, session: MemorySession, *, lost: bool) -> None:
        """Disconnect ``session``; ``lost`` publishes its will."""
        ...

    def subscribe(
        self,
        client_id: str,
        topic_filter: str,
        qos: int,
        *,
        no_local: bool,
        subscription_id: int | None = None,
    ) -> None:
        """Add a subscription."""
        ...

    def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        """Remove a subscription."""
        ...

    def publish(
        self,
        sender_id: str,
        topic: str,
        payload: bytes,
        qos: int,
        *,
        retain: bool = False,
        content_type: str | None = None,
        user_properties: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Route a PUBLISH."""
        ...


class MemorySession(SessionBase):
    """A ``Session`` on a ``MemoryBroker`` (made by ``MemoryBroker.session``)."""

    def __init__(
        self,
        broker: Router,
        settings: BrokerSettings,
        client_id: str,
        *,
        clean_start: bool,
        session_expiry_s: int,
        receive_maximum: int,
        manual_ack: bool,
        will: Will | None,
        publish_timeout_s: float,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self.clean_start = clean_start
        self.session_expiry_s = session_expiry_s
        self.receive_maximum = receive_maximum
        self.will = will
        self.lost = False
        self._broker = broker
        self._client: ClientState | None = None
        self._manual_ack = manual_ack
        self._publish_timeout_s = publish_timeout_s
        self._mids = itertools.count()
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Tell the receiving loop something changed (a message, an ack, a lost link)."""
        self._wake.set()

    def _open(self) -> ClientState:
        if self.lost:
            raise BrokerError(f"connection to {self.settings.url} lost")
        if self._client is None or self._client.session is not self:
            raise BrokerError("the session is not open (use `async with session:`)")
        return self._client

    async def __aenter__(self) -> Self:
        self._client = self._broker.attach(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._broker.detach(self, lost=False)

    @property
    def max_packet_size(self) -> int | None:
        """The broker's maximum packet size."""
        return self._broker.max_packet_size

    async def subscribe(
        self,
        filters: Sequence[str],
        qos: int = 1,
        *,
        no_local: bool = False,
        subscription_id: int | None = None,
    ) -> None:
        """Subscribe to topic filters (including ``$share/<group>/...``)."""
        check_subscription_id(subscription_id)
        self._open()
        for topic_filter in filters:
            self._broker.subscribe(
                self.client_id,
                topic_filter,
                qos,
                no_local=no_local,
                subscription_id=subscription_id,
            )

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Stop new deliveries for these filters (already queued messages still arrive)."""
        self._open()
        for topic_filter in filters:
            self._broker.unsubscribe(self.client_id, topic_filter)

    def publish_started(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
        user_properties: Sequence[tuple[str, str]] | None = None,
        message_expiry_s: int | None = None,  # noqa: ARG002 - nothing expires here
    ) -> asyncio.Future[None]:
        """Route the message now; the future is done at once (the PUBACK)."""
        check_size(topic, payload, self._broker.max_packet_size)
        self._open()
        self._broker.publish(
            self.client_id,
            topic,
            payload,
            qos,
            retain=retain,
            content_type=content_type,
            user_properties=tuple(user_properties or ()),
        )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def sync(self) -> None:
        """Nothing to wait for: ``publish_started`` routed every message when it was called.

        Raises:
            BrokerError: the session is not open, or its connection was lost.
        """
        self._open()

    def abort(self, why: str) -> None:  # noqa: ARG002 - no log here to say it in
        """Lose the connection now, as ``MemoryBroker.drop`` does (the will goes out)."""
        self._broker.detach(self, lost=True)

    def ack(self, message: Message) -> None:
        """Acknowledge a QoS 1 message received with ``manual_ack`` (no-op otherwise)."""
        if self._manual_ack and message.qos > 0 and self._client is not None:
            self._client.inflight.pop(message.mid, None)
            self.wake()

    async def messages(self) -> AsyncIterator[Message]:
        """Received messages, at most ``receive_maximum`` unacknowledged (with manual ack)."""
        while True:
            client = self._open()
            if client.queue and len(client.inflight) < self.receive_maximum:
                message = client.queue.popleft()
                if message.qos > 0:
                    message = replace(message, mid=next(self._mids) % 65_535 + 1)
                    if self._manual_ack:
                        client.inflight[message.mid] = message
                yield message
                continue
            self._wake.clear()
            await self._wake.wait()
