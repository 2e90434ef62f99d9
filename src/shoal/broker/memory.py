"""An in-memory MQTT broker and its ``Session``, for fast tests of component logic.

It does what shoal relies on a broker for: topic filters with ``+`` and ``#``,
``$share/<group>/`` round robin, retained messages, QoS 0 and 1 with manual acknowledgement
and receive-maximum, ``no_local``, persistent sessions (``clean_start=False`` with a session
expiry; unacknowledged messages are delivered again) and wills (``drop`` loses a client's
connection). It is not a broker: no network, ACLs, QoS 2, message or session expiry, queue
limits. Tests of delivery under failure use Mosquitto (the ``broker`` marker).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Self

from shoal.broker._shared import SessionBase, check_size
from shoal.broker.session import Message, SessionFactory, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError
from shoal.schemas.topics import topic_matches

_SHARE = "$share/"


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT matching, where a leading wildcard does not match ``$`` topics (``$SYS``)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    return topic_matches(topic_filter, topic)


def _shared(topic_filter: str) -> tuple[str, str] | None:
    """``$share/g/a/b`` → ``("g", "a/b")``; None for a plain filter."""
    if not topic_filter.startswith(_SHARE):
        return None
    group, _, inner = topic_filter[len(_SHARE) :].partition("/")
    return group, inner


@dataclass(slots=True)
class ClientState:
    """What a ``MemoryBroker`` keeps of a client.

    Attributes:
        subscriptions: topic filter → (QoS, no_local).
        queue: messages not yet handed to the client.
        inflight: messages handed over and not acknowledged yet, by packet id.
        session: the live session, if connected.
    """

    subscriptions: dict[str, tuple[int, bool]] = field(default_factory=dict)
    queue: deque[Message] = field(default_factory=deque)
    inflight: dict[int, Message] = field(default_factory=dict)
    session: MemorySession | None = None


class MemorySession(SessionBase):
    """A ``Session`` on a ``MemoryBroker`` (made by ``MemoryBroker.session``)."""

    def __init__(
        self,
        broker: MemoryBroker,
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
        self, filters: Sequence[str], qos: int = 1, *, no_local: bool = False
    ) -> None:
        """Subscribe to topic filters (including ``$share/<group>/...``)."""
        self._open()
        for topic_filter in filters:
            self._broker.subscribe(self.client_id, topic_filter, qos, no_local=no_local)

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


class MemoryBroker:
    """The broker; ``session_factory`` is what components take to open sessions on it.

    Args:
        max_packet_size: announced to clients; larger publishes raise ``PayloadTooLargeError``.
    """

    def __init__(self, *, max_packet_size: int | None = None) -> None:
        self.max_packet_size = max_packet_size
        self.settings = BrokerSettings(host="memory", port=0)
        self._clients: dict[str, ClientState] = {}
        self._retained: dict[str, Message] = {}
        self._turns: dict[tuple[str, str], int] = {}  # (group, filter) -> messages dealt

    @property
    def session_factory(self) -> SessionFactory:
        """``session``, typed as what components take."""
        return self.session

    def session(
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
    ) -> MemorySession:
        """A new, unconnected session (the arguments of ``SessionFactory``)."""
        return MemorySession(
            self,
            settings,
            client_id,
            clean_start=clean_start,
            session_expiry_s=session_expiry_s,
            receive_maximum=receive_maximum or 65_535,
            manual_ack=manual_ack,
            will=will,
            publish_timeout_s=publish_timeout_s,
        )

    def connected(self) -> list[str]:
        """Client ids of the live sessions."""
        return [cid for cid, client in self._clients.items() if client.session is not None]

    def drop(self, client_id: str) -> None:
        """Lose a client's connection: its will goes out, its iteration raises ``BrokerError``."""
        client = self._clients.get(client_id)
        if client is not None and client.session is not None:
            self.detach(client.session, lost=True)

    # -- what sessions call ----------------------------------------------------------------

    def attach(self, session: MemorySession) -> ClientState:
        """Connect ``session``, resuming its stored state unless it starts clean."""
        client = self._clients.get(session.client_id)
        if client is not None and client.session is not None:
            self.detach(client.session, lost=True)  # session takeover
        if client is None or session.clean_start:
            client = self._clients[session.client_id] = ClientState()
        client.session = session
        # Unacknowledged QoS 1 messages are delivered again, first.
        client.queue.extendleft(reversed([m for _, m in sorted(client.inflight.items())]))
        client.inflight.clear()
        return client

    def detach(self, session: MemorySession, *, lost: bool) -> None:
        """Disconnect ``session``; a ``lost`` one's will is published."""
        client = self._clients.get(session.client_id)
        if client is None or client.session is not session:
            return
        client.session = None
        session.lost = lost
        session.wake()
        for topic_filter in [f for f in client.subscriptions if _shared(f)]:
            self.unsubscribe(session.client_id, topic_filter)  # not restored, as in Mosquitto
        if session.session_expiry_s == 0:
            del self._clients[session.client_id]
        will = session.will
        if lost and will is not None:
            self.publish(session.client_id, will.topic, will.payload, will.qos, retain=will.retain)

    def subscribe(self, client_id: str, topic_filter: str, qos: int, *, no_local: bool) -> None:
        """Add a subscription; a plain one gets the matching retained messages."""
        client = self._clients[client_id]
        client.subscriptions[topic_filter] = (qos, no_local)
        if _shared(topic_filter) is not None:
            return
        for topic, message in self._retained.items():
            if matches(topic_filter, topic):
                self._deliver(client, replace(message, qos=min(qos, message.qos)))

    def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        """Remove a subscription (a shared one takes the client out of its group)."""
        self._clients[client_id].subscriptions.pop(topic_filter, None)

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
        """Route a PUBLISH from ``sender_id`` to the subscriptions it matches."""
        message = Message(topic, payload, qos, retain, content_type, user_properties)
        if message.retain:
            if payload:
                self._retained[topic] = message
            else:
                self._retained.pop(topic, None)
            message = replace(message, retain=False)  # live copies: retain-as-published off
        groups: dict[tuple[str, str], list[tuple[ClientState, int]]] = {}  # members, in order
        for client_id, client in self._clients.items():
            granted = []
            for topic_filter, (sub_qos, no_local) in client.subscriptions.items():
                shared = _shared(topic_filter)
                if not matches(shared[1] if shared else topic_filter, topic):
                    continue
                if shared is not None:
                    groups.setdefault(shared, []).append((client, sub_qos))
                elif not (no_local and client_id == sender_id):
                    granted.append(sub_qos)
            if granted:
                self._deliver(client, replace(message, qos=min(qos, max(granted))))
        for group, members in groups.items():
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            member, sub_qos = members[turn % len(members)]
            self._deliver(member, replace(message, qos=min(qos, sub_qos)))

    def _deliver(self, client: ClientState, message: Message) -> None:
        if client.session is None and message.qos == 0:
            return  # QoS 0 is not queued for an offline client
        client.queue.append(message)
        if client.session is not None:
            client.session.wake()
