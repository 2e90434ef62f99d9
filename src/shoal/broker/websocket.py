"""MQTT over WebSockets for browsers: Mosquitto's own listener when it has one, else a bridge.

Debian bookworm's Mosquitto 2.0.11 is built without libwebsockets: a ``protocol websockets``
listener makes it exit ("Unable to start any listening sockets"). ``mosquitto_has_websockets``
asks the binary once (a probe config on a free loopback port); when it cannot, shoal runs a
``WebSocketBridge``: a WebSocket server (subprotocol ``mqtt``, the ``websockets`` library) that
opens one TCP connection to the broker's plain MQTT listener per browser and copies bytes both
ways without reading them. The broker therefore authenticates the browser's own CONNECT and
applies the ACL to it, exactly as for any MQTT client.

One thing is read: with ``allowed_users`` set (the secure profile: dashboard users only), the
bridge parses the first packet, a CONNECT, and answers a user name outside that set with a
CONNACK "not authorized" itself, so an admin's password does not open the broker to a browser.
A password is never read: the broker checks it. The bridge outlives broker restarts (its
connections drop and browsers reconnect through it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pwd
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final, Self

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from shoal._spawn import spawn_tied
from shoal.broker.probe import free_port
from shoal.errors import BrokerError

log = logging.getLogger(__name__)

SUBPROTOCOL: Final = "mqtt"
MAX_MESSAGE_BYTES: Final = 32 * 1024 * 1024
"""Largest WebSocket message the bridge takes (above every profile's ``max_packet_size``)."""

_CONNECT: Final = 0x10
_CONNACK_REFUSED: Final = {
    5: bytes([0x20, 0x03, 0x00, 0x87, 0x00]),  # MQTT 5: reason 0x87 Not authorized
    4: bytes([0x20, 0x02, 0x00, 0x05]),  # 3.1.1: return code 5, not authorized
    3: bytes([0x20, 0x02, 0x00, 0x05]),
}
_PROBE_TIMEOUT_S: Final = 5.0


class MalformedConnectError(BrokerError):
    """The first packet of a WebSocket connection is not a readable MQTT CONNECT."""


def packet_length(buffer: bytes) -> int | None:
    """Bytes of the first complete MQTT packet in ``buffer`` (None: not all there yet).

    Raises:
        MalformedConnectError: the remaining-length field is longer than MQTT allows.
    """
    multiplier, length = 1, 0
    for index in range(1, 5):
        if index >= len(buffer):
            return None
        byte = buffer[index]
        length += (byte & 0x7F) * multiplier
        if not byte & 0x80:
            total = index + 1 + length
            return total if len(buffer) >= total else None
        multiplier *= 128
    raise MalformedConnectError("remaining length longer than 4 bytes")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise MalformedConnectError("CONNECT ends early")
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def sized(self) -> bytes:
        return self.take(self.u16())

    def varint(self) -> int:
        multiplier, value = 1, 0
        for _ in range(4):
            byte = self.u8()
            value += (byte & 0x7F) * multiplier
            if not byte & 0x80:
                return value
            multiplier *= 128
        raise MalformedConnectError("variable byte integer longer than 4 bytes")


def connect_user(packet: bytes) -> tuple[int, str | None]:
    """(protocol level, user name or None) of an MQTT 3.1, 3.1.1 or 5 CONNECT packet.

    Raises:
        MalformedConnectError: it is not a CONNECT, or cannot be read.
    """
    if not packet or packet[0] != _CONNECT:
        raise MalformedConnectError("the first packet is not a CONNECT")
    reader = _Reader(packet)
    reader.take(1)
    reader.varint()  # remaining length
    reader.sized()  # protocol name
    level = reader.u8()
    if level not in _CONNACK_REFUSED:
        raise MalformedConnectError(f"unknown MQTT protocol level {level}")
    flags = reader.u8()
    reader.u16()  # keep alive
    if level == 5:
        reader.take(reader.varint())  # properties
    reader.sized()  # client id
    if flags & 0x04:  # will
        if level == 5:
            reader.take(reader.varint())
        reader.sized()
        reader.sized()
    if not flags & 0x80:
        return level, None
    try:
        return level, reader.sized().decode()
    except UnicodeDecodeError as exc:
        raise MalformedConnectError("the user name is not UTF-8") from exc


def refusal(level: int) -> bytes:
    """The CONNACK "not authorized" of an MQTT protocol level."""
    return _CONNACK_REFUSED[level]


@functools.cache
def mosquitto_has_websockets(binary: str) -> bool:
    """Whether this ``mosquitto`` can serve ``protocol websockets`` (asked once per binary).

    It is started on a probe config with only a WebSocket listener on a free loopback port:
    without libwebsockets it exits at once; with it, it listens (and is stopped).
    """
    with tempfile.TemporaryDirectory(prefix="shoal-ws-probe-") as folder:
        port = free_port("127.0.0.1")
        config = Path(folder) / "probe.conf"
        config.write_text(
            f"user {pwd.getpwuid(os.getuid()).pw_name}\n"
            f"listener {port} 127.0.0.1\nprotocol websockets\nallow_anonymous true\n"
            f"persistence false\nlog_dest none\n"
        )
        process = spawn_tied(
            [binary, "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + _PROBE_TIMEOUT_S
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    return False
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    return True
                time.sleep(0.05)
            return False
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()


def server_tls(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A TLS (1.2 or newer) server context for ``wss://`` with the broker's certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


class WebSocketBridge:
    """A WebSocket server piping each connection to an MQTT TCP listener (module docstring).

    Runs its own event loop in a daemon thread, so the embedded broker and ``shoal view`` can
    start it from synchronous code.

    Args:
        target_host, target_port: the broker's plain MQTT listener.
        bind, port: where browsers connect (port 0: a free one, see ``port`` once started).
        tls: serve ``wss://`` with this context (None: plain ``ws://``).
        allowed_users: only these user names may connect (None: anyone the broker accepts).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        bind: str = "127.0.0.1",
        port: int = 0,
        tls: ssl.SSLContext | None = None,
        allowed_users: Iterable[str] | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.bind = bind
        self._port = port
        self.tls = tls
        self.allowed_users = None if allowed_users is None else frozenset(allowed_users)
        self.connections = 0
        self.refused = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        """The port browsers connect to (known once started)."""
        return self._port

    @property
    def url(self) -> str:
        """``ws://`` or ``wss://`` with the listen address (loopback for any address)."""
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "", "::") else self.bind  # noqa: S104
        return f"{'wss' if self.tls else 'ws'}://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Self:
        """Listen (in a thread); returns once browsers can connect.

        Raises:
            BrokerError: the port could not be bound.
        """
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="shoal-ws-bridge", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self._thread = None
            raise BrokerError(
                f"the WebSocket bridge could not listen on {self.bind}:{self._port}: {self._error}"
            )
        return self

    def stop(self) -> None:
        """Close the listener and every bridged connection."""
        thread, self._thread = self._thread, None
        if thread is None or self._loop is None or self._stop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has ended already
            self._loop.call_soon_threadsafe(self._stop.set)
        thread.join(5.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server: Server
        async with serve(
            self._serve,
            self.bind,
            self._port,
            subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
            ssl=self.tls,
            compression=None,  # a byte pipe: MQTT payloads are often compressed already
            max_size=MAX_MESSAGE_BYTES,
        ) as server:
            self._port = server.sockets[0].getsockname()[1] if server.sockets else self._port
            self._ready.set()
            await self._stop.wait()
            server.close(close_connections=True)

    async def _serve(self, ws: ServerConnection) -> None:
        self.connections += 1
        try:
            reader, writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.info("ws bridge: broker %s:%s unreachable: %s", *self.target, exc)
            await ws.close(1011, "broker unreachable")
            return
        try:
            if self.allowed_users is not None and not await self._admit(ws, writer):
                return
            pumps = [
                asyncio.create_task(self._to_broker(ws, writer)),
                asyncio.create_task(self._to_browser(reader, ws)),
            ]
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            await ws.close()

    async def _admit(self, ws: ServerConnection, writer: asyncio.StreamWriter) -> bool:
        """Read the CONNECT; pass it on if its user may connect, else refuse it here."""
        buffer = b""
        try:
            while (length := packet_length(buffer)) is None:
                buffer += _as_bytes(await ws.recv())
            level, user = connect_user(buffer[:length])
        except (MalformedConnectError, ConnectionClosed) as exc:
            log.info("ws bridge: closing a connection without a readable CONNECT: %s", exc)
            return False
        assert self.allowed_users is not None
        if user not in self.allowed_users:
            self.refused += 1
            log.info("ws bridge: refused user %r (not a dashboard user)", user)
            with contextlib.suppress(ConnectionClosed):
                await ws.send(refusal(level))
            return False
        writer.write(buffer)
        await writer.drain()
        return True

    @staticmethod
    async def _to_broker(ws: ServerConnection, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionClosed, OSError):
            async for message in ws:
                writer.write(_as_bytes(message))
                await writer.drain()

    @staticmethod
    async def _to_browser(reader: asyncio.StreamReader, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed, OSError):
            while chunk := await reader.read(65536):
                await ws.send(chunk)


def _as_bytes(message: str | bytes) -> bytes:
    return message.encode() if isinstance(message, str) else bytes(message)
