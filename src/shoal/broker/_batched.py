"""``BatchedSession``: the ``Session`` for high-rate intake (``shoal adapt``), on ``mqtt5``.

Why not aiomqtt/paho here (``docs/benchmarks.md``, "Device adapters"): paho builds a
``Properties`` object for every PUBLISH it reads (tables of all 27 MQTT 5 properties, then a
``hasattr`` per property to clear them): 19.6 of the 23.5 us its ``decode_publish`` takes,
measured. Driven from asyncio in batches, paho alone drains 13,343 messages/s (75 us of CPU
each) on this machine, a quarter of the adapter's target before any decoding; through
aiomqtt's queue, 280 us per message. ``mqtt5`` (Rust, sans-I/O, by aiomqtt's maintainer;
aiomqtt 3 is built on it) reads a PUBLISH in 0.5 us and reads and writes every packet here; this
module is the I/O around it that a sans-I/O library leaves to its user: an asyncio
connection, CONNECT/CONNACK, packet identifiers, QoS 1 acknowledgements both ways,
keep-alive, DISCONNECT. Only what the ``Session`` Protocol needs: QoS 0 and 1 (deliveries
come at the subscription's QoS, at most 1), no topic aliases (Topic Alias Maximum 0 is
announced), no enhanced authentication.

Receiving: each chunk the connection delivers is read into messages at once and the consumer
is woken once for all of them: ``message_batches`` yields them as one list and ``ack_many``
writes their PUBACKs in one write. Past ``max_buffered_bytes`` of payload waiting to be taken
the connection stops reading (TCP holds the broker back: Mosquitto 2.0.11 stops honouring
Receive Maximum after the first PUBACKs), except while one of our publishes waits for its
PUBACK (a consumer may wait for it before taking more).

Sending: QoS 0 publishes started in one turn of the event loop go out in one write at the end
of it (up to ``CORK_BYTES``), in order with everything else written: a combiner publishing a
window's 10,000 per-key results makes a few hundred system calls instead of 10,000.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Final, Self

import mqtt5

from shoal.broker._packets import Qos0Packets
from shoal.broker._paho_glue import tls_context
from shoal.broker._shared import (
    SUBSCRIBE_ATTEMPTS,
    SessionBase,
    check_column_sizes,
    check_size,
    check_subscription_id,
    only_packet_id_in_use,
    reply_while_receiving,
)
from shoal.broker.session import Message, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError

DEFAULT_BUFFERED_BYTES: Final = 16 * 1024 * 1024
"""Payload bytes that may wait to be taken when the caller sets no bound."""
CORK_BYTES: Final = 256 * 1024
"""QoS 0 packets gathered for one write at most (``publish_started``): past it, written now."""
_CONNECT_TIMEOUT_S: Final = 10.0
_CLOSE_TIMEOUT_S: Final = 1.0
"""How long leaving a session waits for its connection to be closed before it aborts it: a
TLS close waits for the broker's close_notify, and a loop that ends first (``asyncio.run``)
would leave the socket open behind it."""


READ_BYTES: Final = 256 * 1024
"""What one read of the socket takes at most (asyncio's own read size)."""
BOUNDED_READ_BYTES: Final = 4 * 1024
"""What one read takes at most for a session bounded in messages (``max_buffered_messages``):
a pool combiner hosts a thousand partition intakes with a bound of 2 messages each, and a
256 KiB read would take every partial the broker had written to the socket into the process
(Mosquitto sends past the Receive Maximum once a client acknowledges) before the bound stops
the next read. In 4 KiB reads the rest stays in the kernel's socket buffer; a larger packet
takes several reads (a worker, holding one session, reads larger pieces: ``read_bytes``)."""
_reads = threading.local()


def _read_buffer() -> bytearray:
    """This thread's buffer that sockets are read into, one for every session.

    Each read is copied out at once (``_Connection.buffer_updated``).
    """
    buffer: bytearray | None = getattr(_reads, "buffer", None)
    if buffer is None:
        buffer = _reads.buffer = bytearray(READ_BYTES)
    return buffer


class _Connection(asyncio.BufferedProtocol):
    """Bytes in, packets out: every complete packet of each chunk, read with ``mqtt5.read``."""

    def __init__(self, session: BatchedSession, read_bytes: int = READ_BYTES) -> None:
        self.session = session
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done once the transport is closed (``connection_lost``)."""
        self._buffer = bytearray()
        self._read_bytes = read_bytes

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next read goes: ``read_bytes`` of this thread's read buffer."""
        del sizehint
        return memoryview(_read_buffer())[: self._read_bytes]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were read into the read buffer: take the packets they complete."""
        self.data_received(memoryview(_read_buffer())[:nbytes])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self.session._lost(f"the connection was closed{f' ({exc})' if exc else ''}")

    def data_received(self, data: bytes | memoryview) -> None:
        session = self.session
        session._last_in = time.monotonic()
        buffer = self._buffer
        buffer += data
        view = memoryview(buffer)
        pos = 0
        read = mqtt5.read
        publish = mqtt5.PublishPacket
        try:
            while pos < len(buffer):
                try:
                    packet, size = read(view[pos:])
                except IndexError:
                    break  # the rest of a packet is still on its way
                pos += size
                if type(packet) is publish:
                    session._on_publish(packet)
                else:
                    session._on_control(packet)
        except ValueError as exc:  # a malformed packet: nothing after it can be trusted
            session._lost(f"the broker sent a malformed packet: {exc}")
            if self.transport is not None:
                self.transport.abort()
        finally:
            view.release()
            del buffer[:pos]
        session._delivered()


class BatchedSession(SessionBase):
    """The ``Session`` Protocol on ``mqtt5``, delivering in batches; a ``SessionFactory``.

    See ``shoal.broker.session.SessionFactory`` for the arguments; ``max_buffered_bytes``
    None means ``DEFAULT_BUFFERED_BYTES`` here; ``max_buffered_messages`` (None: no bound)
    pauses reading past that many messages waiting, as the bytes bound does; ``read_bytes``
    None means ``READ_BYTES`` (also its most), or ``BOUNDED_READ_BYTES`` for a session
    bounded in messages.
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
        read_bytes: int | None = None,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self._clean_start = clean_start
        self._session_expiry_s = session_expiry_s
        self._receive_maximum = receive_maximum
        self._manual_ack = manual_ack
        self._will = will
        self._publish_timeout_s = publish_timeout_s
        self._limit = max_buffered_bytes or DEFAULT_BUFFERED_BYTES
        self._message_limit = max_buffered_messages
        default = READ_BYTES if max_buffered_messages is None else BOUNDED_READ_BYTES
        self._read_bytes = min(read_bytes or default, READ_BYTES)  # the read buffer's size
        self._conn: _Connection | None = None
        self._connack: asyncio.Future[mqtt5.ConnAckPacket] | None = None
        self._max_packet_size: int | None = None
        self._quota = 65_535
        self._next_id = 0
        self._replies: dict[int, asyncio.Future[Any]] = {}  # SUBACK/UNSUBACK by packet id
        self._published: dict[int, asyncio.Future[None]] = {}  # PUBACK by packet id
        self._queued: deque[tuple[int, bytes]] = deque()  # QoS 1 beyond the broker's quota
        self._waiting: deque[Message] = deque()
        self._waiting_bytes = 0
        self._paused = False
        self._wake: asyncio.Future[None] | None = None
        self._gone: str | None = None
        self._received = 0
        self._last_in = 0.0
        self._last_out = 0.0
        self._keepalive: asyncio.Task[None] | None = None
        self._corked: list[bytes] = []  # QoS 0 packets for the write at the end of this turn
        self._packets = Qos0Packets()
        self._corked_bytes = 0
        self._pings: deque[asyncio.Future[None] | None] = deque()
        """PINGREQs written, oldest first: a ``sync`` waits for its PINGRESP (None: keep-alive)."""
        self.pauses = 0
        self.writes = 0
        """Writes handed to the connection (QoS 0 packets gathered count once)."""

    # -- connection -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        settings = self.settings
        context = tls_context(settings)
        self._connack = loop.create_future()
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, self._read_bytes),
                    settings.host,
                    settings.port,
                    ssl=context,
                    server_hostname=settings.host if context is not None else None,
                )
                self._conn = conn
                self._write(self._connect_packet())
                connack = await self._connack
        except (OSError, TimeoutError, BrokerError) as exc:
            self._close()
            raise BrokerError(
                f"cannot connect to the broker at {settings.url} as {self.client_id!r}: {exc}"
            ) from exc
        if int(connack.reason_code) >= 0x80:
            self._close()
            raise BrokerError(
                f"the broker at {settings.url} refused {self.client_id!r}: "
                f"{connack.reason_code.name}"
            )
        self._max_packet_size = connack.max_packet_size
        self._quota = connack.receive_max
        keepalive = connack.server_keep_alive or settings.keepalive_s
        self._keepalive = asyncio.create_task(self._keep_alive(keepalive))
        return self

    def _connect_packet(self) -> bytes:
        settings, will = self.settings, self._will
        return mqtt5.ConnectPacket(
            self.client_id,
            username=settings.username,
            password=settings.password.encode() if settings.password is not None else None,
            clean_start=self._clean_start,
            will=None
            if will is None
            else mqtt5.Will(
                will.topic, payload=will.payload, qos=mqtt5.QoS(will.qos), retain=will.retain
            ),
            keep_alive=settings.keepalive_s,
            session_expiry_interval=self._session_expiry_s,
            receive_max=self._receive_maximum or 65_535,
        ).write()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._gone is None:
            with contextlib.suppress(BrokerError):
                self._write(mqtt5.DisconnectPacket().write())
        self._lost("the session was closed")
        self._close()
        conn = self._conn
        if conn is not None and conn.transport is not None:
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                    await asyncio.shield(conn.closed)
            except TimeoutError:
                conn.transport.abort()

    def _close(self) -> None:
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    async def _keep_alive(self, keepalive_s: int) -> None:
        """PINGREQ when we have been quiet; the connection is lost when the broker is."""
        if keepalive_s <= 0:
            return
        while self._gone is None:
            await asyncio.sleep(keepalive_s / 2)
            now = time.monotonic()
            if now - self._last_in > 1.5 * keepalive_s:
                self._lost(f"nothing from the broker for {1.5 * keepalive_s:.0f} s")
                self._close()
                return
            if now - self._last_out >= keepalive_s / 2:
                with contextlib.suppress(BrokerError):
                    self._write(mqtt5.PingReqPacket().write())
                    self._pings.append(None)

    async def sync(self) -> None:
        """Return once the broker has processed everything written on this connection so far.

        A PINGREQ written after it, answered: a broker reads a connection's packets in order
        and handles a PUBLISH (routed, retained) before it reads the next packet, so its
        PINGRESP comes after every earlier publish, QoS 0 ones included, took effect.

        Raises:
            BrokerError: the connection was lost, or no PINGRESP within the publish timeout.
        """
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._write(mqtt5.PingReqPacket().write())
        self._pings.append(answered)
        try:
            async with asyncio.timeout(self._publish_timeout_s):
                await answered
        except TimeoutError as exc:
            raise BrokerError(f"no PINGRESP within {self._publish_timeout_s} s") from exc

    def abort(self, why: str) -> None:
        """Drop the connection now, without sending what is still buffered (a TCP reset)."""
        self._lost(why)
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.abort()

    def _write(self, data: bytes) -> None:
        """Write ``data`` now, after the QoS 0 packets gathered so far (``_write_soon``)."""
        conn = self._conn
        if self._gone is not None or conn is None or conn.transport is None:
            self._corked.clear()
            self._corked_bytes = 0
            raise BrokerError(f"not connected to {self.settings.url}: {self._gone or 'closed'}")
        if self._corked:
            self._corked.append(data)
            data = b"".join(self._corked)
            self._corked.clear()
            self._corked_bytes = 0
        conn.transport.write(data)
        self.writes += 1
        self._last_out = time.monotonic()

    def _write_soon(self, data: bytes) -> None:
        """Gather a QoS 0 packet for one write at the end of this turn of the event loop.

        Raises:
            BrokerError: not connected (the packet is not sent).
        """
        if self._gone is not None or self._conn is None or self._conn.transport is None:
            raise BrokerError(f"not connected to {self.settings.url}: {self._gone or 'closed'}")
        if not self._corked:
            asyncio.get_running_loop().call_soon(self._flush_corked)
        self._corked.append(data)
        self._corked_bytes += len(data)
        if self._corked_bytes >= CORK_BYTES:
            self._flush_corked()

    def _flush_corked(self) -> None:
        """Write the gathered QoS 0 packets (lost with the connection, as QoS 0 may be)."""
        if self._corked:
            with contextlib.suppress(BrokerError):
                self._write(self._corked.pop())

    def _lost(self, why: str) -> None:
        """The connection is over: fail what waits for the broker, wake the consumer."""
        if self._gone is not None:
            return
        self._gone = why
        error = BrokerError(f"connection to {self.settings.url} lost: {why}")
        pings = [p for p in self._pings if p is not None]
        self._pings.clear()
        for fut in (*self._replies.values(), *self._published.values(), *pings):
            if not fut.done():
                fut.set_exception(error)
        self._replies.clear()
        self._published.clear()
        if self._connack is not None and not self._connack.done():
            self._connack.set_exception(error)
        self._wakeup()

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from CONNACK (None: the broker set no limit)."""
        return self._max_packet_size

    @property
    def send_quota(self) -> int:
        """QoS 1 publishes kept unacknowledged at once: the CONNACK's Receive Maximum."""
        return self._quota

    # -- packets from the broker -------------------------------------------------------------

    def _on_publish(self, packet: mqtt5.PublishPacket) -> None:
        qos = int(packet.qos)
        mid = packet.packet_id or 0
        payload = packet.payload
        self._waiting.append(
            Message(
                packet.topic,
                payload,
                qos,
                packet.retain,
                packet.content_type,
                tuple(packet.user_properties),
                mid,
                packet.payload_format_indicator or None,
                tuple(packet.subscription_ids),
            )
        )
        self._waiting_bytes += len(payload)
        self._received += 1
        if qos > 1:
            self._lost("the broker sent a QoS 2 message (subscriptions ask for QoS 1 at most)")
            self._close()
        elif qos == 1 and not self._manual_ack:
            self._write(mqtt5.PubAckPacket(mid).write())

    def _on_control(self, packet: Any) -> None:
        kind = type(packet)
        if kind is mqtt5.PubAckPacket:
            fut = self._published.pop(packet.packet_id, None)
            if fut is not None and not fut.done():
                if int(packet.reason_code) >= 0x80:
                    fut.set_exception(
                        BrokerError(f"broker refused a publish: {packet.reason_code.name}")
                    )
                else:
                    fut.set_result(None)
            self._send_queued()
        elif kind is mqtt5.SubAckPacket or kind is mqtt5.UnsubAckPacket:
            reply = self._replies.pop(packet.packet_id, None)
            if reply is not None and not reply.done():
                reply.set_result([int(c) for c in packet.reason_codes])
        elif kind is mqtt5.ConnAckPacket:
            if self._connack is not None and not self._connack.done():
                self._connack.set_result(packet)
        elif kind is mqtt5.DisconnectPacket:
            self._lost(f"the broker disconnected us: {packet.reason_code.name}")
        elif kind is mqtt5.PingRespPacket:
            answered = self._pings.popleft() if self._pings else None
            if answered is not None and not answered.done():
                answered.set_result(None)
        else:
            self._lost(f"the broker sent an unexpected {kind.__name__}")
            self._close()

    def _delivered(self) -> None:
        """A chunk was read: wake the consumer; stop reading if too much waits."""
        if (
            self._over_limit()
            and not self._published
            and not self._paused
            and self._conn is not None
            and self._conn.transport is not None
        ):
            self._conn.transport.pause_reading()
            self._paused = True
            self.pauses += 1
        self._wakeup()

    def _resume(self) -> None:
        if self._paused and self._conn is not None and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    # -- requests ---------------------------------------------------------------------------

    def _packet_id(self) -> int:
        for _ in range(65_535):
            self._next_id = self._next_id % 65_535 + 1
            if self._next_id not in self._published and self._next_id not in self._replies:
                return self._next_id
        raise BrokerError("no free packet identifier (65,535 requests in flight)")

    async def _request(self, packet_id: int, data: bytes, what: str) -> list[int]:
        """Send a SUBSCRIBE/UNSUBSCRIBE and wait for its reply while messages keep coming."""
        reply: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._replies[packet_id] = reply
        self._write(data)
        try:
            return await reply_while_receiving(reply, lambda: self._received, what)
        except BrokerError as exc:
            self._replies.pop(packet_id, None)
            if reply.done():  # the reply itself failed (a lost connection fails them all)
                raise BrokerError(f"{what} failed: {exc}") from exc
            raise

    async def subscribe(
        self,
        filters: Sequence[str],
        qos: int = 1,
        *,
        no_local: bool = False,
        subscription_id: int | None = None,
    ) -> None:
        """Subscribe to topic filters (``$share/<group>/...`` too), with an identifier."""
        check_subscription_id(subscription_id)
        topic_filters = [
            mqtt5.TopicFilter(
                f, max_qos=mqtt5.QoS(qos), no_local=no_local, retain_as_published=False
            )
            for f in filters
        ]
        what = f"subscribe to {list(filters)}"
        codes: list[int] = []
        for _ in range(SUBSCRIBE_ATTEMPTS):
            pid = self._packet_id()
            packet = mqtt5.SubscribePacket(pid, topic_filters, subscription_id=subscription_id)
            codes = await self._request(pid, packet.write(), what)
            # Mochi 2.7.9 refuses a SUBSCRIBE whose packet id a queued message holds; the
            # next SUBSCRIBE has another id (``only_packet_id_in_use``).
            if not only_packet_id_in_use(codes):
                break
        refused = [f for f, c in zip(filters, codes, strict=False) if c >= 0x80]
        if refused:
            raise BrokerError(f"the broker refused subscriptions {refused}: {codes}")

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Stop new deliveries for these filters (already queued messages still arrive)."""
        pid = self._packet_id()
        packet = mqtt5.UnsubscribePacket(pid, list(filters))
        await self._request(pid, packet.write(), f"unsubscribe from {list(filters)}")

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
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pid = self._packet_id() if qos > 0 else None
        try:
            data = mqtt5.PublishPacket(
                topic,
                payload,
                qos=mqtt5.QoS(qos),
                retain=retain,
                packet_id=pid,
                content_type=content_type,
                user_properties=list(user_properties) if user_properties else None,
                message_expiry_interval=message_expiry_s,
            ).write()
            if pid is None:
                self._write_soon(data)
                fut.set_result(None)
                return fut
            self._published[pid] = fut
            if len(self._published) - len(self._queued) <= self._quota:
                self._write(data)
            else:
                self._queued.append((pid, data))  # beyond the broker's Receive Maximum
        except BrokerError as exc:
            self._published.pop(pid or 0, None)
            fut.set_exception(exc)
        self._resume()  # its PUBACK must be read
        return fut

    def publish_columns(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        *,
        retain: bool = False,
        head: bytes = b"",
    ) -> None:
        """QoS 0 messages ``zip(topics, payloads)`` to the connection now, in order, in one write.

        A window's per-key results: one ``publish_started`` each cost a future, a packet
        object and a write request per message, and a combiner of 100,000 keys at a 1 s step
        publishes 100,000 of them a second; their packets are built column by column
        (``_packets``; docs/benchmarks.md, "Sliding: two stacks, one encoding, bulk per-key
        publishes"). Raises as ``Session.publish_columns`` says.
        """
        check_column_sizes(topics, payloads, head, self._max_packet_size)
        data = self._packets.build_columns(topics, payloads, retain=retain, head=head)
        if data:
            self._write_soon(data)

    def _send_queued(self) -> None:
        while self._queued and len(self._published) - len(self._queued) < self._quota:
            pid, data = self._queued.popleft()
            if pid in self._published:
                self._write(data)

    def ack(self, message: Message) -> None:
        """PUBACK a QoS 1 message received with ``manual_ack`` (no-op otherwise)."""
        self.ack_many((message,))

    def ack_many(self, messages: Sequence[Message]) -> None:
        """PUBACK each of ``messages`` (QoS 1, ``manual_ack``), in order, in one write.

        Not on a lost connection: the broker sends them again to the next one (as paho).
        """
        if self._manual_ack and self._gone is None:
            packet = mqtt5.PubAckPacket
            acks = b"".join([packet(m.mid).write() for m in messages if m.qos > 0])
            if acks:
                self._write(acks)

    # -- receiving --------------------------------------------------------------------------

    def _take(self, most: int | None) -> list[Message]:
        waiting = self._waiting
        if most is None or most >= len(waiting):
            taken = list(waiting)
            waiting.clear()
        else:
            taken = [waiting.popleft() for _ in range(most)]
        self._waiting_bytes -= sum(len(m.payload) for m in taken)
        if self._waiting_bytes <= self._limit // 2 and (
            self._message_limit is None or len(waiting) <= self._message_limit // 2
        ):
            self._resume()
        return taken

    def _over_limit(self) -> bool:
        """Whether what waits to be taken reached a bound (bytes, or messages if bounded)."""
        return self._waiting_bytes >= self._limit or (
            self._message_limit is not None and len(self._waiting) >= self._message_limit
        )

    async def _arrived(self, stop: asyncio.Event | None) -> bool:
        """Wait until messages wait (True) or ``stop`` is set (False).

        Raises:
            BrokerError: the connection was lost first.
        """
        if self._waiting:
            return True  # the common case under load: no task, no future
        stopper = None if stop is None else asyncio.ensure_future(stop.wait())
        try:
            while not self._waiting:
                if self._gone is not None:
                    raise BrokerError(f"connection to {self.settings.url} lost: {self._gone}")
                if stop is not None and stop.is_set():
                    return False
                wake = self._wake = asyncio.get_running_loop().create_future()
                waits: set[asyncio.Future[Any]] = {wake}
                if stopper is not None:
                    waits.add(stopper)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return True
        finally:
            self._wake = None
            if stopper is not None:
                stopper.cancel()

    async def message_batches(self, stop: asyncio.Event) -> AsyncIterator[list[Message]]:
        """What each read of the connection brought, in arrival order, until ``stop``.

        Raises:
            BrokerError: the connection was lost.
        """
        while await self._arrived(stop):
            yield self._take(None)

    async def messages(self) -> AsyncIterator[Message]:
        """Received messages, in arrival order, until the connection drops.

        Raises:
            BrokerError: the connection was lost.
        """
        while await self._arrived(None):
            yield self._take(1)[0]

    def messages_until(self, stop: asyncio.Event) -> AsyncIterator[Message]:
        """Received messages until ``stop`` is set (then it simply ends)."""
        return self._until(stop)

    async def _until(self, stop: asyncio.Event) -> AsyncIterator[Message]:
        while await self._arrived(stop):
            yield self._take(1)[0]
