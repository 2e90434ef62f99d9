"""``AsyncSession``: the ``Session`` on aiomqtt, for pipeline components.

Manual acknowledgement, CONNACK properties and PUBACK reason codes are not in aiomqtt's
public API; ``paho_client_of`` is the one place that reaches past it.

Received messages wait in aiomqtt's queue until ``messages`` takes them, and aiomqtt reads
the socket whenever it is readable: a consumer slower than its input would queue without
bound. The broker does not hold the rest back: Mosquitto 2.0.11 honours a client's Receive
Maximum only until the client starts acknowledging, then sends whatever is queued (measured:
112 messages held for 4 announced, ``tests/integration/test_session_contract.py``). One read
gate (``_ReadGate``) bounds that queue, in bytes (``max_buffered_bytes``), in messages
(``max_buffered_messages``, usually the receive maximum), or both: past a bound the socket is
not read until the consumer has taken enough (half the bytes, one message), so TCP holds the
sender back and the rest waits in the broker's queue for this session.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from shoal.broker._paho_glue import (
    NO_DELAY,
    adopt_send_quota,
    connect_properties,
    message_properties,
    payload_format,
    publish_error,
    publish_properties,
    reason_failed,
    reason_value,
    subscribe_properties,
    tls_context,
)
from shoal.broker._shared import (
    SUBSCRIBE_ATTEMPTS,
    SessionBase,
    check_size,
    check_subscription_id,
    only_packet_id_in_use,
    reply_while_receiving,
)
from shoal.broker.session import Message, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError

T = TypeVar("T")


def paho_client_of(client: aiomqtt.Client) -> paho.Client:
    """The paho client inside an aiomqtt client (its private ``_client``).

    aiomqtt has no manual acknowledgement (empicano/aiomqtt#345, draft PR #346) and its
    maintainers prefer not to expose the paho client (empicano/aiomqtt#191); CONNACK
    properties and PUBACK reason codes are only visible to paho's callbacks. This is the one
    place that reaches in; ``tests/unit/broker/test_aio.py`` pins what we rely on.
    """
    inner: paho.Client = client._client
    return inner


class AsyncSession(SessionBase):
    """The ``Session`` Protocol over aiomqtt (MQTT 5); also its ``SessionFactory``.

    See ``shoal.broker.session.SessionFactory`` for the arguments.
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
        max_buffered_bytes: int | None = None,
        max_buffered_messages: int | None = None,
        read_bytes: int | None = None,  # paho reads whole packets: nothing to size
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self._manual_ack = manual_ack
        self._publish_timeout_s = publish_timeout_s
        self._options = (clean_start, session_expiry_s, receive_maximum, will)
        self._max_packet_size: int | None = None  # from CONNACK
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._client_obj: aiomqtt.Client | None = None
        self._paho_obj: paho.Client | None = None
        self._gate = _ReadGate(max_buffered_bytes, max_buffered_messages)
        self._received = 0  # messages received on this connection (a reply's progress)
        self._link_lost = asyncio.Event()

    @property
    def _client(self) -> aiomqtt.Client:
        if self._client_obj is None:
            raise BrokerError("the session is not open (use `async with session:`)")
        return self._client_obj

    @property
    def _paho(self) -> paho.Client:
        if self._paho_obj is None:
            raise BrokerError("the session is not open (use `async with session:`)")
        return self._paho_obj

    def _build(self) -> aiomqtt.Client:
        clean_start, session_expiry_s, receive_maximum, will = self._options
        settings = self.settings
        client = aiomqtt.Client(
            settings.host,
            settings.port,
            username=settings.username,
            password=settings.password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            # Not paho's MQTT_CLEAN_START_FIRST_ONLY: every AsyncSession is a new paho client,
            # so its first (and only) connect would start clean and discard the stored session.
            clean_start=clean_start,
            keepalive=settings.keepalive_s,
            properties=connect_properties(session_expiry_s, receive_maximum),
            tls_context=tls_context(settings),
            tls_insecure=(not settings.tls.verify_hostname) if settings.tls else None,
            will=aiomqtt.Will(will.topic, will.payload, will.qos, will.retain) if will else None,
            timeout=10,
            socket_options=[NO_DELAY],
        )
        client.pending_calls_threshold = 1_000_000  # in-flight work is bounded by the caller
        return client

    def _wrap_callbacks(self, inner: paho.Client) -> None:
        on_connect: Any = inner.on_connect
        on_publish: Any = inner.on_publish
        on_message: Any = inner.on_message
        on_disconnect: Any = inner.on_disconnect

        def connect_hook(
            client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any = None
        ) -> None:
            if props is not None:
                self._max_packet_size = getattr(props, "MaximumPacketSize", None)
            if not reason_failed(reason):
                adopt_send_quota(client, props)
            on_connect(client, userdata, flags, reason, props)

        def publish_hook(
            client: paho.Client, userdata: Any, mid: int, reason: ReasonCode, props: Any
        ) -> None:
            fut = self._pending.pop(mid, None)
            if fut is not None and not fut.done():
                if reason_failed(reason):
                    fut.set_exception(BrokerError(f"broker refused a publish: {reason}"))
                else:
                    fut.set_result(None)
            on_publish(client, userdata, mid, reason, props)

        def message_hook(client: paho.Client, userdata: Any, message: Any) -> None:
            self._received += 1
            on_message(client, userdata, message)  # aiomqtt queues it
            self._gate.queued(client, len(message.payload))

        def read_failed(exc: Exception) -> None:  # what aiomqtt's own reader does
            disconnected: asyncio.Future[None] = self._client._disconnected
            if not disconnected.done():
                disconnected.set_exception(exc)

        def disconnect_hook(*args: Any) -> None:
            # At once, not at __aexit__: a component stopping after the broker died waits
            # for these (a last checkpoint, a drain) and must not wait for the timeout.
            self._fail_pending("connection lost before the PUBACK arrived")
            self._link_lost.set()
            on_disconnect(*args)

        inner.on_connect = connect_hook
        inner.on_publish = publish_hook
        inner.on_message = message_hook
        inner.on_disconnect = disconnect_hook
        self._gate.failed = read_failed

    def _fail_pending(self, why: str) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BrokerError(why))
        self._pending.clear()

    def _prepare(self) -> aiomqtt.Client:
        """The client, built and wired (manual ack, our callbacks), not yet connected."""
        client = self._client_obj = self._build()
        inner = self._paho_obj = paho_client_of(client)
        inner.manual_ack_set(self._manual_ack)
        self._wrap_callbacks(inner)
        return client

    async def __aenter__(self) -> Self:
        self._gate.loop = asyncio.get_running_loop()
        client = self._prepare()
        try:
            await client.__aenter__()
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
        self._fail_pending("connection closed before the PUBACK arrived")
        with contextlib.suppress(aiomqtt.MqttError):
            await self._client.__aexit__(exc_type, exc, tb)

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from CONNACK (None: the broker set no limit)."""
        return self._max_packet_size

    @property
    def send_quota(self) -> int | None:
        """QoS 1 publishes kept unacknowledged at once (None before the first connection).

        The broker's CONNACK Receive Maximum (``adopt_send_quota``).
        """
        return None if self._paho_obj is None else self._paho_obj.max_inflight_messages

    async def subscribe(
        self,
        filters: Sequence[str],
        qos: int = 1,
        *,
        no_local: bool = False,
        subscription_id: int | None = None,
    ) -> None:
        """Subscribe to topic filters (``$share/<group>/...`` too), with an identifier.

        ``subscription_id`` applies to all of ``filters`` (``Session.subscribe``).
        """
        check_subscription_id(subscription_id)
        options = SubscribeOptions(qos=qos, noLocal=no_local)
        what = f"subscribe to {list(filters)}"
        for attempt in range(SUBSCRIBE_ATTEMPTS):
            result = await self._reply(
                self._client.subscribe(
                    [(f, options) for f in filters],
                    properties=subscribe_properties(subscription_id),
                    timeout=math.inf,  # ``_reply`` decides how long
                ),
                what,
            )
            # Mochi 2.7.9 refuses a SUBSCRIBE whose packet id a queued message holds; the
            # next SUBSCRIBE has another id (``only_packet_id_in_use``).
            codes = [reason_value(code) for code in result]
            if attempt + 1 == SUBSCRIBE_ATTEMPTS or not only_packet_id_in_use(codes):
                break
        failed = [
            f
            for f, code in zip(filters, result, strict=False)
            if reason_failed(code)  # type: ignore[arg-type]
        ]
        if failed:
            raise BrokerError(f"the broker refused subscriptions {failed}: {result}")

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Stop new deliveries for these filters (already queued messages still arrive)."""
        await self._reply(
            self._client.unsubscribe(list(filters), timeout=math.inf),
            f"unsubscribe from {list(filters)}",
        )

    async def _reply(self, call: Coroutine[Any, Any, T], what: str) -> T:
        """``call``'s reply, waited for while messages keep coming (``reply_while_receiving``).

        Raises:
            BrokerError: the reply failed, the connection was lost, or it went quiet.
        """
        task = asyncio.ensure_future(call)
        lost = asyncio.ensure_future(self._link_lost.wait())
        try:
            with self._gate.asking(self._paho):  # the socket is read while we wait
                return await reply_while_receiving(task, lambda: self._received, what, lost)
        except aiomqtt.MqttError as exc:
            raise BrokerError(f"{what} failed: {exc}") from exc
        finally:
            lost.cancel()
            task.cancel()

    def _answer_awaited(self) -> contextlib.AbstractContextManager[None]:
        """``publish`` awaits its PUBACK in line: the socket is read meanwhile (``_ReadGate``)."""
        return self._gate.asking(self._paho)

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

        Raises:
            PayloadTooLargeError: larger than the broker's maximum packet size; not sent.
        """
        check_size(topic, payload, self._max_packet_size)
        props = publish_properties(content_type, user_properties, message_expiry_s)
        info = self._paho.publish(topic, payload, qos=qos, retain=retain, properties=props)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if info.rc != paho.MQTT_ERR_SUCCESS:
            fut.set_exception(publish_error(topic, info.rc))
        elif qos == 0 or info.is_published():
            fut.set_result(None)
        else:
            self._pending[info.mid] = fut
        return fut

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
        try:
            while True:
                try:
                    msg = await iterator.__anext__()
                except aiomqtt.MqttError as exc:
                    raise BrokerError(f"connection to {self.settings.url} lost: {exc}") from exc
                payload = bytes(msg.payload) if isinstance(msg.payload, bytes | bytearray) else b""
                self._gate.taken(self._paho, len(payload))
                yield _message(msg, payload)
        finally:
            # Nobody takes messages any more: read on (PUBACKs awaited after the iteration).
            self._gate.open(self._paho)


def _message(msg: aiomqtt.Message, payload: bytes) -> Message:
    content_type, user_properties, ids = message_properties(msg.properties)
    return Message(
        topic=msg.topic.value,
        payload=payload,
        qos=msg.qos,
        retain=bool(msg.retain),
        content_type=content_type,
        user_properties=user_properties,
        mid=msg.mid,
        payload_format=payload_format(msg.properties),
        subscription_ids=ids,
    )


STALL_S: Final = 0.5
"""How long the read gate stays closed while one of our requests waits and no message is
taken: then its caller is taken to await the answer in line (nobody will take a message
before it comes), and the socket is read past the bound until the answer is in."""


class _ReadGate:
    """Stops reading the socket while too much received waits to be taken.

    Too much: ``max_bytes`` bytes or ``max_messages`` messages (either None: no bound of
    that kind). ``queued`` runs in paho's message callback (aiomqtt has just queued the
    message), ``taken`` when ``messages`` takes one. At a bound the socket's reader is
    removed; it is read again, by ``_read`` (what aiomqtt's own reader does), once the
    consumer has taken enough: the bytes waiting down to half ``max_bytes`` and fewer than
    ``max_messages`` messages. While paused, answers to our own requests wait too: while a
    request waits (``asking``: ``publish``, ``subscribe``, ``unsubscribe``) and no message
    has been taken for ``STALL_S``, its caller awaits it in line and nobody will take one,
    so the socket is read past the bound until the answer is in; a request awaited beside a
    consumer that keeps taking messages (a resumed session's SUBSCRIBE, whose SUBACK comes
    after the backlog; a scale-down's UNSUBSCRIBE) leaves the bound in force. The socket is
    also read once the iteration of ``messages`` has ended (``open``: a last checkpoint
    waits for its PUBACKs). A consumer that awaits PUBACKs of ``publish_started`` must do so
    in another task than the one taking messages.

    Known overshoot: paho's ``loop_read`` reads up to as many packets as it has messages in
    flight both ways, so one read can bring that many past the bound before the reader is
    removed.
    """

    def __init__(self, max_bytes: int | None, max_messages: int | None) -> None:
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self.buffered = 0
        """Bytes received and not taken yet."""
        self.waiting = 0
        """Messages received and not taken yet."""
        self.paused_fd: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pauses = 0
        self.failed: Callable[[Exception], None] | None = None
        """Told of a read error (the connection is broken)."""
        self._asking = 0
        self._taken = 0
        """Messages taken so far (whether a consumer takes any while a request waits)."""
        self._in_line = False
        """A request waits and no message was taken for ``STALL_S``: read past the bound."""
        self._watch: asyncio.TimerHandle | None = None

    def queued(self, client: paho.Client, size: int) -> None:
        self.buffered += size
        self.waiting += 1
        self._check(client)

    def taken(self, client: paho.Client, size: int) -> None:
        self.buffered = max(0, self.buffered - size)
        self.waiting = max(0, self.waiting - 1)
        self._taken += 1
        self._in_line = False  # somebody takes messages: nobody waits in line
        self._check(client)

    @contextlib.contextmanager
    def asking(self, client: paho.Client) -> Iterator[None]:
        """Around a request whose answer is awaited in line: the socket is read meanwhile."""
        self._asking += 1
        self._check(client)
        try:
            yield
        finally:
            self._asking -= 1
            if not self._asking:
                self._in_line = False
            self._check(client)

    def open(self, client: paho.Client) -> None:
        """No bound any more (nobody takes messages): read the socket again if paused."""
        self.max_bytes = self.max_messages = None
        with contextlib.suppress(RuntimeError):  # finalised outside the loop: it is closed
            self._check(client)

    def _full(self) -> bool:
        return (self.max_bytes is not None and self.buffered >= self.max_bytes) or (
            self.max_messages is not None and self.waiting >= self.max_messages
        )

    def _room(self) -> bool:
        return (self.max_bytes is None or self.buffered <= self.max_bytes // 2) and (
            self.max_messages is None or self.waiting < self.max_messages
        )

    def _check(self, client: paho.Client) -> None:
        if self.loop is None:
            return
        reads_on = self._asking > 0 and self._in_line
        if self.paused_fd is None:
            if reads_on or not self._full():
                return
            sock = client.socket()
            if sock is None:
                return
            self.paused_fd = sock.fileno()
            self.loop.remove_reader(self.paused_fd)
            self.pauses += 1
        elif reads_on or self._room():
            fd, self.paused_fd = self.paused_fd, None
            sock = client.socket()
            if sock is None or sock.fileno() != fd:
                return  # the connection is gone: aiomqtt's iterator reports it
            self.loop.add_reader(fd, self._read, client)
            return
        if self._asking and self._watch is None:  # paused while a request waits: watch
            self._watch = self.loop.call_later(STALL_S, self._stalled, client, self._taken)

    def _stalled(self, client: paho.Client, taken: int) -> None:
        """``STALL_S`` after a request began waiting behind the closed gate."""
        self._watch = None
        if self._asking and self._taken == taken:
            self._in_line = True  # nobody took a message meanwhile: its caller waits in line
        self._check(client)

    def _read(self, client: paho.Client) -> None:
        try:
            while True:
                client.loop_read()
                sock: Any = client.socket()
                if sock is not None and hasattr(sock, "pending") and sock.pending() > 0:
                    continue  # TLS: decrypted bytes paho has not read yet
                break
        except Exception as exc:  # noqa: BLE001 - as aiomqtt's reader: a broken connection
            if self.failed is not None:
                self.failed(exc)
