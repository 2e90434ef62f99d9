"""Looking at the network before connecting: a free TCP port, whether a broker answers on one.

Plain sockets; no MQTT library.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Final

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
