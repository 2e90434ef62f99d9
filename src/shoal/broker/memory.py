"""An in-memory MQTT broker and its ``Session``, for fast tests of component logic.

It does what shoal relies on a broker for: topic filters with ``+`` and ``#``,
``$share/<group>/`` round robin, retained messages, QoS 0 and 1 with manual acknowledgement
and receive-maximum, ``no_local``, persistent sessions (``clean_start=False`` with a session
expiry; unacknowledged messages are delivered again) and wills (``drop`` loses a client's
connection). It is not a broker: no network, ACLs, QoS 2, message or session expiry, queue
limits. Tests of delivery under failure use Mosquitto (the ``broker`` marker).
"""

from __future__ import annotations

from dataclasses import replace

from shoal.broker._memory_session import ClientState, MemorySession
from shoal.broker.session import Message, SessionFactory, Will
from shoal.broker.settings import BrokerSettings
from shoal.schemas.topics import topic_matches

_SHARE = "$share/"


def _shared(topic_filter: str) -> tuple[str, str] | None:
    """``$share/g/a/b`` → ``("g", "a/b")``; None for a plain filter."""
    if not topic_filter.startswith(_SHARE):
        return None
    group, _, inner = topic_filter[len(_SHARE) :].partition("/")
    return group, inner


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
        max_buffered_bytes: int | None = None,  # noqa: ARG002 - nothing waits in process here
        max_buffered_messages: int | None = None,  # noqa: ARG002 - likewise
        read_bytes: int | None = None,  # noqa: ARG002 - no socket
    ) -> MemorySession:
        """A new, unconnected session (the arguments of ``SessionFactory``).

        ``max_buffered_bytes`` and ``max_buffered_messages`` have nothing to bound: a memory
        session hands over one message at a time from the broker's queue, and this broker
        holds to the receive maximum.
        """
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

    def subscribe(
        self,
        client_id: str,
        topic_filter: str,
        qos: int,
        *,
        no_local: bool,
        subscription_id: int | None = None,
    ) -> None:
        """Add (or replace) a subscription; a plain one gets the matching retained messages."""
        client = self._clients[client_id]
        client.subscriptions[topic_filter] = (qos, no_local, subscription_id)
        if _shared(topic_filter) is not None:
            return
        ids = () if subscription_id is None else (subscription_id,)
        for topic, message in self._retained.items():
            if topic_matches(topic_filter, topic):
                qos_out = min(qos, message.qos)
                self._deliver(client, replace(message, qos=qos_out, subscription_ids=ids))

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
        # Shared groups: members in order, each with its QoS and subscription identifier.
        groups: dict[tuple[str, str], list[tuple[ClientState, int, int | None]]] = {}
        for client_id, client in self._clients.items():
            granted, ids = [], []
            for topic_filter, (sub_qos, no_local, sid) in client.subscriptions.items():
                shared = _shared(topic_filter)
                if not topic_matches(shared[1] if shared else topic_filter, topic):
                    continue
                if shared is not None:
                    groups.setdefault(shared, []).append((client, sub_qos, sid))
                elif not (no_local and client_id == sender_id):
                    granted.append(sub_qos)
                    ids += [] if sid is None else [sid]
            if granted:
                # Overlapping plain subscriptions: one copy naming all their identifiers.
                copy = replace(message, qos=min(qos, max(granted)), subscription_ids=tuple(ids))
                self._deliver(client, copy)
        for group, members in groups.items():
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            member, sub_qos, sid = members[turn % len(members)]
            one = () if sid is None else (sid,)
            self._deliver(member, replace(message, qos=min(qos, sub_qos), subscription_ids=one))

    def _deliver(self, client: ClientState, message: Message) -> None:
        if client.session is None and message.qos == 0:
            return  # QoS 0 is not queued for an offline client
        client.queue.append(message)
        if client.session is not None:
            client.session.wake()
