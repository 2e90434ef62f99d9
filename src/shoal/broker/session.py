"""The MQTT vocabulary runtime code types against: messages, wills, and the session Protocols.

No third-party imports. Components (worker, combiner, scaler, monitor, client, archive) take
a ``SessionFactory`` and talk to the broker only through the ``Session`` it opens; gateways
take a ``GatewaySessionFactory`` the same way. Implementations: ``shoal.broker.AsyncSession``
and ``shoal.broker.ThreadedSession`` (aiomqtt and paho, a real broker) and
``shoal.broker.memory`` (an in-memory broker for fast logic tests).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol, Self, runtime_checkable

from shoal.broker.settings import BrokerSettings

PROTOCOL_OVERHEAD: Final = 512
"""Bytes a PUBLISH needs beyond its payload for the fixed header, topic and properties; used
when checking a payload against the broker's maximum packet size."""

MAX_SUBSCRIPTION_ID: Final = 268_435_455
"""The largest MQTT 5 Subscription Identifier (a variable byte integer)."""

_instance_counter = itertools.count()


def unique_client_id(prefix: str) -> str:
    """A client id no other live client uses: prefix, host, pid and a counter.

    Reusing a live client id makes the broker disconnect the other client (a "session
    takeover"), so every worker incarnation gets a fresh one.
    """
    host = socket.gethostname().split(".")[0][:20]
    return f"{prefix}-{host}-{os.getpid()}-{next(_instance_counter)}-{os.urandom(2).hex()}"


@dataclass(frozen=True, slots=True)
class Message:
    """A received PUBLISH.

    Attributes:
        topic: the topic it was published to.
        payload: its bytes.
        qos: delivery QoS.
        retain: whether it came from the broker's retained store.
        content_type: the MQTT 5 content type, if the publisher set one.
        user_properties: MQTT 5 user properties, in order.
        mid: packet id, used to acknowledge it (0 for QoS 0).
        payload_format: the MQTT 5 payload format indicator (0: bytes, 1: UTF-8 text), if set.
        subscription_ids: the MQTT 5 Subscription Identifiers of the subscriptions it was
            delivered for (``Session.subscribe(..., subscription_id=...)``); empty when
            none of them had one. A client with several shared subscriptions on one filter
            gets one delivery per group, each naming its own subscription.
    """

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    content_type: str | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    mid: int = 0
    payload_format: int | None = None
    subscription_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Will:
    """A message the broker publishes if we vanish without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


class Session(Protocol):
    """One MQTT 5 connection for an asyncio component (worker, combiner, scaler, client).

    Use as an async context manager; a session does not reconnect. Components reconnect by
    opening a new one, which is also when they must subscribe again (Mosquitto does not
    restore ``$share`` subscriptions). QoS 1 publishes complete on a successful PUBACK; a
    failing reason code, a lost connection or no PUBACK in time raise ``BrokerError``.
    """

    settings: BrokerSettings
    client_id: str

    async def __aenter__(self) -> Self:
        """Connect. Raises ``BrokerError`` if the broker cannot be reached or refuses us."""

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Disconnect cleanly (the will is not published); pending publishes fail."""

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from CONNACK (None: the broker set no limit)."""

    async def subscribe(
        self,
        filters: Sequence[str],
        qos: int = 1,
        *,
        no_local: bool = False,
        subscription_id: int | None = None,
    ) -> None:
        """Subscribe to topic filters (including ``$share/<group>/...``).

        ``subscription_id`` (1 to ``MAX_SUBSCRIPTION_ID``) is the MQTT 5 Subscription
        Identifier of all of ``filters``: messages delivered for them carry it in
        ``Message.subscription_ids``. Subscribing to a filter again replaces its
        subscription, identifier included; messages already queued keep the old one.
        """

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Stop new deliveries for these filters (already queued messages still arrive)."""

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
        """Hand a message to the connection now; the future completes on PUBACK (QoS 1).

        Lets a caller start several publishes and await them together, keeping their order.

        Raises:
            PayloadTooLargeError: larger than the broker's maximum packet size; not sent.
        """

    def publish_many(
        self, messages: Sequence[tuple[str, bytes]], *, retain: bool = False, head: bytes = b""
    ) -> None:
        """Hand QoS 0 messages (topic, payload) to the connection now, in order.

        For many small messages at once (a window's per-key results): no future per message,
        as QoS 0 has no outcome to wait for. Each message's payload is ``head`` followed by
        its own bytes (a beginning they share, given once).

        Raises:
            PayloadTooLargeError: one is larger than the broker's maximum packet size; none
                was sent.
            BrokerError: not connected.
        """

    def publish_columns(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        *,
        retain: bool = False,
        head: bytes = b"",
    ) -> None:
        """``publish_many`` of ``zip(topics, payloads)``, given as two columns.

        A window's per-key results at 100,000 keys: a (topic, payload) tuple per message
        is a container the garbage collector then walks (docs/benchmarks.md, branch slpub).

        Raises:
            PayloadTooLargeError: one is larger than the broker's maximum packet size; none
                was sent.
            BrokerError: not connected.
        """

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
        """Publish and, for QoS 1, wait until the broker has accepted it (PUBACK)."""

    async def wait_published(self, futures: Sequence[asyncio.Future[None]]) -> None:
        """Wait for PUBACKs of publishes started with ``publish_started``."""

    def ack(self, message: Message) -> None:
        """PUBACK a QoS 1 message received with ``manual_ack`` (no-op otherwise)."""

    def messages(self) -> AsyncIterator[Message]:
        """Received messages, in arrival order; raises ``BrokerError`` when the link drops."""

    def messages_until(self, stop: asyncio.Event) -> AsyncIterator[Message]:
        """Received messages until ``stop`` is set (then it simply ends)."""

    def message_batches(self, stop: asyncio.Event) -> AsyncIterator[list[Message]]:
        """Received messages in arrival order, in the groups they arrived in, until ``stop``.

        A group is what one read of the connection brought (one message each where the
        session takes them one by one). Raises ``BrokerError`` when the link drops.
        """

    def ack_many(self, messages: Sequence[Message]) -> None:
        """``ack`` each of ``messages``, in order."""


@runtime_checkable
class FencedSession(Session, Protocol):
    """A ``Session`` that can tell when the broker has processed what it wrote, and be dropped.

    What ``shoal.broker.pooled`` needs to end a lease on a shared connection: ``sync`` is the
    fence (QoS 0 publishes included, which no PUBACK confirms), ``abort`` the reset when the
    fence does not come. ``BatchedSession`` and the in-memory session have both; a pool
    refuses a session factory whose sessions do not.
    """

    async def sync(self) -> None:
        """Return once the broker has processed everything written on this connection so far.

        Raises:
            BrokerError: the connection was lost, or the broker did not answer in time.
        """

    def abort(self, why: str) -> None:
        """Drop the connection now, without sending what is still buffered (its Will fires)."""


class SessionFactory(Protocol):
    """Opens a ``Session`` (not yet connected); ``AsyncSession`` itself is one.

    Args:
        settings: where the broker is.
        client_id: unique per live client (``unique_client_id``).
        clean_start: start without a stored session.
        session_expiry_s: how long the broker keeps our session after we vanish (0: never).
        receive_maximum: at most this many unacknowledged QoS 1 messages in flight to us.
        manual_ack: PUBACK incoming QoS 1 messages only when ``Session.ack`` is called.
        will: message the broker publishes if we disappear.
        publish_timeout_s: how long ``publish`` waits for a PUBACK.
        max_buffered_bytes: received bytes that may wait for ``messages`` to take them;
            past it the session stops reading from the broker until half is taken (the
            in-process bound of a consumer slower than its input; None: no bound).
        max_buffered_messages: received messages that may wait for ``messages`` to take
            them; at it the session reads no more until one is taken. With
            ``receive_maximum`` equal to it, the session holds to its receive maximum itself
            (Mosquitto 2.0.11 sends past it once a client acknowledges; ``shoal.broker._aio``),
            so a backlog waits in the broker, not in memory. For a caller that iterates
            ``messages`` once and keeps taking them (awaiting PUBACKs of
            ``publish_started`` in other tasks, or in line through ``publish``).
        read_bytes: what one read of the socket takes at most, for a session that reads
            in chunks (``BatchedSession``; paho reads whole packets); None: the session's
            own choice. A session bounded in messages may hold one read past its bound:
            small reads for a process that holds hundreds of such sessions, larger ones
            where a message is large (a worker's batches).
    """

    def __call__(
        self,
        settings: BrokerSettings,
        client_id: str,
        *,
        clean_start: bool = True,
        session_expiry_s: int = 0,
        receive_maximum: int | None = None,
        manual_ack: bool = False,
        will: Will | None = None,
        publish_timeout_s: float = 30.0,
        max_buffered_bytes: int | None = None,
        max_buffered_messages: int | None = None,
        read_bytes: int | None = None,
    ) -> Session:
        """A new, unconnected session."""


class PublishHandle(Protocol):
    """A QoS 1 publish in flight from a ``GatewaySession``.

    Attributes:
        failed: why the broker refused it or it was lost (None: not failed, so far).
    """

    failed: str | None

    @property
    def mid(self) -> int:
        """The packet id."""

    def is_acknowledged(self) -> bool:
        """Whether the broker has accepted it (PUBACK with a success code)."""

    def wait(self, timeout_s: float) -> bool:
        """Wait for the PUBACK; False on timeout. Raises ``BrokerError`` if refused."""


class GatewaySession(Protocol):
    """A self-reconnecting MQTT 5 connection with its own network thread (for gateways).

    Callbacks run on that thread. ``on_connect`` runs after every (re)connection: subscribe
    there. ``on_acknowledged`` runs whenever a publish settles. Publishes made while
    disconnected fail fast with ``BrokerError``; the gateway's spool owns retrying.
    """

    @property
    def connected(self) -> bool:
        """Whether the session is connected right now."""

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from the last CONNACK."""

    def start(self) -> None:
        """Start connecting in the background (returns at once)."""

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected; False on timeout."""

    def stop(self) -> None:
        """Disconnect cleanly and stop the network thread."""

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        """Subscribe (call from ``on_connect`` so it is renewed after reconnects)."""

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
    ) -> PublishHandle:
        """Start a publish; the handle reports its PUBACK (``BrokerError``: not connected)."""


class GatewaySessionFactory(Protocol):
    """Makes a ``GatewaySession``; ``ThreadedSession`` itself is one."""

    def __call__(
        self,
        settings: BrokerSettings,
        client_id: str,
        *,
        on_message: Callable[[Message], None] | None = None,
        on_connect: Callable[[GatewaySession], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_acknowledged: Callable[[], None] | None = None,
        session_expiry_s: int = 0,
        will: Will | None = None,
    ) -> GatewaySession:
        """A new, unstarted session."""
