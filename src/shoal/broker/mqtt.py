"""The one module that speaks MQTT; nothing else in shoal imports paho-mqtt or aiomqtt.

An asyncio session serves pipeline components, a threaded one serves gateways.

Both sessions speak MQTT 5 and expose the same small vocabulary: ``Message`` in, ``publish``
out (QoS 1 waits for a successful PUBACK; a failing reason code raises ``BrokerError``),
``subscribe``/``unsubscribe``, and, for the asyncio session, manual acknowledgement so that a
component acks its input only once its output is safe (see ``AsyncSession.ack``).

Flow control comes from MQTT receive-maximum, never from an unbounded queue of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError, PayloadTooLargeError

log = logging.getLogger(__name__)

NO_DELAY: Final = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
"""Disable Nagle's algorithm: paho leaves it on, and Nagle plus delayed ACKs holds small
packets (PUBACKs, small partials) back for up to 40 ms."""

PROTOCOL_OVERHEAD: Final = 512
"""Bytes a PUBLISH needs beyond its payload for the fixed header, topic and properties; used
when checking a payload against the broker's maximum packet size."""

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
    """

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    content_type: str | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    mid: int = 0


@dataclass(frozen=True, slots=True)
class Will:
    """A message the broker publishes if we vanish without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


@dataclass(slots=True)
class _ConnackInfo:
    maximum_packet_size: int | None = None
    receive_maximum: int | None = None


def _publish_properties(
    content_type: str | None,
    user_properties: Sequence[tuple[str, str]] | None,
    message_expiry_s: int | None,
) -> Properties | None:
    if content_type is None and not user_properties and message_expiry_s is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if content_type is not None:
        props.ContentType = content_type
    if user_properties:
        props.UserProperty = list(user_properties)
    if message_expiry_s is not None:
        props.MessageExpiryInterval = message_expiry_s
    return props


def _message_from_paho(msg: paho.MQTTMessage) -> Message:
    props = getattr(msg, "properties", None)
    content_type = getattr(props, "ContentType", None) if props is not None else None
    user = getattr(props, "UserProperty", None) if props is not None else None
    return Message(
        topic=msg.topic,
        payload=bytes(msg.payload),
        qos=msg.qos,
        retain=bool(msg.retain),
        content_type=content_type,
        user_properties=tuple(user) if user else (),
        mid=msg.mid,
    )


def _tls_context(settings: BrokerSettings) -> ssl.SSLContext | None:
    tls = settings.tls
    if tls is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
        if tls.cert_file is not None:
            context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise BrokerError(f"cannot load TLS files for {settings.url}: {exc}") from exc
    context.check_hostname = tls.verify_hostname
    return context


def _check_size(topic: str, payload: bytes, limit: int | None) -> None:
    if limit is not None and len(payload) + len(topic) + PROTOCOL_OVERHEAD > limit:
        raise PayloadTooLargeError(
            f"message for {topic!r} is {len(payload)} bytes; the broker accepts packets of at "
            f"most {limit} bytes. It was not sent: split it or raise the broker's max_packet_size."
        )


def _reason_failed(reason: ReasonCode | int) -> bool:
    if isinstance(reason, ReasonCode):
        return bool(reason.is_failure)
    return reason != 0


# --------------------------------------------------------------------------------------------
# The asyncio session, for pipeline components.


class AsyncSession:
    """One MQTT 5 connection for an asyncio component (worker, combiner, scaler, client).

    Use as an async context manager; the connection is not re-established by this class.
    Components reconnect by opening a new session (see ``sessions``), which is also when
    they must subscribe again: Mosquitto does not restore ``$share`` subscriptions.

    Args:
        settings: where the broker is.
        client_id: unique per live client (``unique_client_id``).
        clean_start: start without a stored session.
        session_expiry_s: how long the broker keeps our session after we vanish (0: never).
        receive_maximum: at most this many unacknowledged QoS 1 messages in flight to us.
        manual_ack: PUBACK incoming QoS 1 messages only when ``ack`` is called.
        will: message the broker publishes if we disappear.
        publish_timeout_s: how long ``publish`` waits for a PUBACK.
    """

    def __init__(
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
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self._manual_ack = manual_ack
        self._publish_timeout_s = publish_timeout_s
        self._options = (clean_start, session_expiry_s, receive_maximum, will)
        self._connack = _ConnackInfo()
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._client_obj: aiomqtt.Client | None = None

    @property
    def _client(self) -> aiomqtt.Client:
        if self._client_obj is None:
            raise BrokerError("the session is not open (use `async with session:`)")
        return self._client_obj

    @property
    def _paho(self) -> paho.Client:
        # aiomqtt keeps the paho client private; the seams we need (manual ack, CONNACK
        # properties, PUBACK reason codes) live there, so this is the one place we reach in.
        client: paho.Client = self._client._client
        return client

    def _build(self) -> aiomqtt.Client:
        clean_start, session_expiry_s, receive_maximum, will = self._options
        connect_props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        connect_props.SessionExpiryInterval = session_expiry_s
        if receive_maximum is not None:
            connect_props.ReceiveMaximum = receive_maximum
        settings = self.settings
        client = aiomqtt.Client(
            settings.host,
            settings.port,
            username=settings.username,
            password=settings.password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=True if clean_start else paho.MQTT_CLEAN_START_FIRST_ONLY,
            keepalive=settings.keepalive_s,
            properties=connect_props,
            tls_context=_tls_context(settings),
            tls_insecure=(not settings.tls.verify_hostname) if settings.tls else None,
            will=aiomqtt.Will(will.topic, will.payload, will.qos, will.retain) if will else None,
            timeout=10,
            socket_options=[NO_DELAY],
        )
        client.pending_calls_threshold = 1_000_000  # in-flight work is bounded by the caller
        return client

    def _wrap_callbacks(self) -> None:
        on_connect: Any = self._paho.on_connect
        on_publish: Any = self._paho.on_publish

        def connect_hook(
            client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any = None
        ) -> None:
            if props is not None:
                self._connack.maximum_packet_size = getattr(props, "MaximumPacketSize", None)
                self._connack.receive_maximum = getattr(props, "ReceiveMaximum", None)
            on_connect(client, userdata, flags, reason, props)

        def publish_hook(
            client: paho.Client, userdata: Any, mid: int, reason: ReasonCode, props: Any
        ) -> None:
            fut = self._pending.pop(mid, None)
            if fut is not None and not fut.done():
                if _reason_failed(reason):
                    fut.set_exception(BrokerError(f"broker refused a publish: {reason}"))
                else:
                    fut.set_result(None)
            on_publish(client, userdata, mid, reason, props)

        self._paho.on_connect = connect_hook
        self._paho.on_publish = publish_hook

    async def __aenter__(self) -> Self:
        self._client_obj = self._build()
        self._paho.manual_ack_set(self._manual_ack)
        self._wrap_callbacks()
        try:
            await self._client.__aenter__()
        except aiomqtt.MqttError as exc:
            raise BrokerError(
                f"cannot connect to the broker at {self.settings.url} as {self.client_id!r}: {exc}"
            ) from exc
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BrokerError("connection closed before the PUBACK arrived"))
        self._pending.clear()
        with contextlib.suppress(aiomqtt.MqttError):
            await self._client.__aexit__(exc_type, exc, tb)

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from CONNACK (None: the broker set no limit)."""
        return self._connack.maximum_packet_size

    async def subscribe(
        self, filters: Sequence[str], qos: int = 1, *, no_local: bool = False
    ) -> None:
        """Subscribe to topic filters (including ``$share/<group>/...``)."""
        options = SubscribeOptions(qos=qos, noLocal=no_local)
        try:
            result = await self._client.subscribe([(f, options) for f in filters])
        except aiomqtt.MqttError as exc:
            raise BrokerError(f"subscribe to {list(filters)} failed: {exc}") from exc
        failed = [
            f
            for f, code in zip(filters, result, strict=False)
            if _reason_failed(code)  # type: ignore[arg-type]
        ]
        if failed:
            raise BrokerError(f"the broker refused subscriptions {failed}: {result}")

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Stop new deliveries for these filters (already queued messages still arrive)."""
        try:
            await self._client.unsubscribe(list(filters))
        except aiomqtt.MqttError as exc:
            raise BrokerError(f"unsubscribe from {list(filters)} failed: {exc}") from exc

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
        """
        _check_size(topic, payload, self._connack.maximum_packet_size)
        props = _publish_properties(content_type, user_properties, message_expiry_s)
        info = self._paho.publish(topic, payload, qos=qos, retain=retain, properties=props)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if info.rc != paho.MQTT_ERR_SUCCESS:
            fut.set_exception(
                BrokerError(f"publish to {topic!r} failed: {paho.error_string(info.rc)}")
            )
        elif qos == 0 or info.is_published():
            fut.set_result(None)
        else:
            self._pending[info.mid] = fut
        return fut

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
        await self.wait_published([fut])

    async def wait_published(self, futures: Sequence[asyncio.Future[None]]) -> None:
        """Wait for PUBACKs of publishes started with ``publish_started``."""
        if not futures:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*futures), timeout=self._publish_timeout_s)
        except TimeoutError as exc:
            raise BrokerError(f"no PUBACK within {self._publish_timeout_s} s") from exc

    def ack(self, message: Message) -> None:
        """PUBACK a QoS 1 message received with ``manual_ack`` (no-op otherwise)."""
        if self._manual_ack and message.qos > 0:
            self._paho.ack(message.mid, message.qos)

    async def messages(self) -> AsyncIterator[Message]:
        """Received messages, in arrival order, until the connection drops.

        Raises:
            BrokerError: the connection was lost.
        """
        iterator = self._client.messages
        while True:
            try:
                msg = await iterator.__anext__()
            except aiomqtt.MqttError as exc:
                raise BrokerError(f"connection to {self.settings.url} lost: {exc}") from exc
            props = msg.properties
            content_type = getattr(props, "ContentType", None) if props is not None else None
            user = getattr(props, "UserProperty", None) if props is not None else None
            yield Message(
                topic=msg.topic.value,
                payload=bytes(msg.payload) if isinstance(msg.payload, bytes | bytearray) else b"",
                qos=msg.qos,
                retain=bool(msg.retain),
                content_type=content_type,
                user_properties=tuple(user) if user else (),
                mid=msg.mid,
            )

    async def messages_until(self, stop: asyncio.Event) -> AsyncIterator[Message]:
        """Received messages until ``stop`` is set (then it simply ends).

        Raises:
            BrokerError: the connection was lost first.
        """
        iterator = self.messages().__aiter__()
        stopper = asyncio.ensure_future(stop.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:
                    yield nxt.result()
                    continue
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, BrokerError):
                    await nxt
                return
        finally:
            stopper.cancel()


# --------------------------------------------------------------------------------------------
# The threaded session, for gateways.


class PublishHandle:
    """A QoS 1 publish in flight from a ``ThreadedSession``."""

    def __init__(self, info: paho.MQTTMessageInfo, done: threading.Event) -> None:
        self._info = info
        self._done = done
        self.failed: str | None = None

    @property
    def mid(self) -> int:
        """The packet id."""
        return self._info.mid

    def is_acknowledged(self) -> bool:
        """Whether the broker has accepted it (PUBACK with a success code)."""
        return self._done.is_set() and self.failed is None

    def wait(self, timeout_s: float) -> bool:
        """Wait for the PUBACK; False on timeout. Raises BrokerError if refused."""
        ok = self._done.wait(timeout_s)
        if ok and self.failed is not None:
            raise BrokerError(f"broker refused a publish: {self.failed}")
        return ok


class ThreadedSession:
    """A self-reconnecting MQTT 5 connection driven by paho's network thread (for gateways).

    Callbacks run on that thread. ``on_connect`` runs after every (re)connection: subscribe
    there. ``on_acknowledged`` runs whenever a publish settles (PUBACK or failure), so an
    owner can wake up instead of polling its handles. Publishes made while disconnected fail
    fast with ``BrokerError``; the gateway's spool owns retrying.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        client_id: str,
        *,
        on_message: Callable[[Message], None] | None = None,
        on_connect: Callable[[ThreadedSession], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_acknowledged: Callable[[], None] | None = None,
        session_expiry_s: int = 0,
        will: Will | None = None,
    ) -> None:
        self.settings = settings
        self._on_acknowledged = on_acknowledged
        self.client_id = client_id
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._connected = threading.Event()
        self._lock = threading.Lock()  # guards _pending/_early; never held while calling paho
        self._pending: dict[int, PublishHandle] = {}
        self._early: dict[int, ReasonCode | int] = {}
        self._max_packet_size: int | None = None
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv5,
            reconnect_on_failure=True,
        )
        if settings.username is not None:
            self._client.username_pw_set(settings.username, settings.password)
        context = _tls_context(settings)
        if context is not None:
            self._client.tls_set_context(context)
        if will is not None:
            self._client.will_set(will.topic, will.payload, will.qos, will.retain)
        self._client.reconnect_delay_set(min_delay=1, max_delay=5)
        self._client.max_inflight_messages_set(100)
        self._session_expiry_s = session_expiry_s
        self._client.on_connect = self._handle_connect
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_publish = self._handle_publish
        self._client.on_message = self._handle_message
        self._client.on_socket_open = _no_delay
        self._started = False

    @property
    def connected(self) -> bool:
        """Whether the session is connected right now."""
        return self._connected.is_set()

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from the last CONNACK."""
        return self._max_packet_size

    def start(self) -> None:
        """Start connecting in the background (returns at once)."""
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self._session_expiry_s
        self._client.connect_async(
            self.settings.host,
            self.settings.port,
            keepalive=self.settings.keepalive_s,
            clean_start=True,
            properties=props,
        )
        self._client.loop_start()
        self._started = True

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected; False on timeout."""
        return self._connected.wait(timeout_s)

    def stop(self) -> None:
        """Disconnect cleanly and stop the network thread."""
        if not self._started:
            return
        self._client.disconnect()
        self._client.loop_stop()
        self._started = False
        self._connected.clear()

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        """Subscribe (call from ``on_connect`` so it is renewed after reconnects)."""
        self._client.subscribe(topic_filter, qos=qos)

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
    ) -> PublishHandle:
        """Start a publish; the handle reports its PUBACK.

        Raises:
            PayloadTooLargeError: larger than the broker accepts; not sent.
            BrokerError: not connected.
        """
        _check_size(topic, payload, self._max_packet_size)
        if not self._connected.is_set():
            raise BrokerError(f"not connected to {self.settings.url}")
        props = _publish_properties(content_type, None, None)
        # Not under self._lock: paho's thread calls on_publish holding paho's message mutex,
        # which paho's publish() takes too; holding ours across it would deadlock (AB/BA).
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise BrokerError(f"publish to {topic!r} failed: {paho.error_string(info.rc)}")
        handle = PublishHandle(info, threading.Event())
        if qos == 0:
            handle._done.set()
            return handle
        with self._lock:
            early = self._early.pop(info.mid, None)
            if early is None:
                self._pending[info.mid] = handle
        if early is not None:  # the PUBACK raced ahead of publish() returning
            self._settle(handle, early)
        return handle

    def _settle(self, handle: PublishHandle, reason: ReasonCode | int) -> None:
        if _reason_failed(reason):
            handle.failed = str(reason)
        handle._done.set()
        if self._on_acknowledged is not None:
            self._on_acknowledged()

    def _handle_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any = None
    ) -> None:
        if _reason_failed(reason):
            log.warning("broker %s refused the connection: %s", self.settings.url, reason)
            return
        self._max_packet_size = getattr(props, "MaximumPacketSize", None) if props else None
        self._connected.set()
        if self._on_connect is not None:
            self._on_connect(self)

    def _handle_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any = None
    ) -> None:
        self._connected.clear()
        with self._lock:
            # In-flight publishes will never be acknowledged on this connection.
            for handle in self._pending.values():
                handle.failed = f"disconnected ({reason})"
                handle._done.set()
            self._pending.clear()
            self._early.clear()
        if self._on_disconnect is not None:
            self._on_disconnect()

    def _handle_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode, props: Any
    ) -> None:
        with self._lock:
            handle = self._pending.pop(mid, None)
            if handle is None:
                self._early[mid] = reason  # PUBACK raced ahead of publish() returning
                return
        self._settle(handle, reason)

    def _handle_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        if self._on_message is not None:
            try:
                self._on_message(_message_from_paho(msg))
            except Exception:
                log.exception("message handler failed for %s", msg.topic)


def _no_delay(client: paho.Client, userdata: Any, sock: Any) -> None:
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(*NO_DELAY)


_PROBE_CONNECT: Final = bytes(
    # MQTT 3.1.1 CONNECT: protocol "MQTT" level 4, clean session, keepalive 10 s, empty id.
    [0x10, 12, 0x00, 0x04, *b"MQTT", 0x04, 0x02, 0x00, 0x0A, 0x00, 0x00]
)


def probe_broker(host: str, port: int, timeout_s: float) -> bool:
    """Whether an MQTT broker answers a CONNECT with a CONNACK on host:port.

    Any CONNACK counts, even "not authorised": the broker is up. A bare TCP listener that
    is not a broker does not pass.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host, port), timeout=0.5) as sock,
        ):
            sock.sendall(_PROBE_CONNECT)
            sock.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
            if sock.recv(4)[:1] == b"\x20":
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
