"""A tiny HTTP endpoint: Prometheus metrics, and JSON for KEDA's ``metrics-api`` scaler.

``GET /metrics``: Prometheus text exposition. ``GET /api/v1/scaling`` (the scaler only): a
JSON object whose ``desired_workers`` a KEDA ``ScaledObject`` can target (``valueLocation:
desired_workers``, ``targetValue: "1"``), with the lag figures beside it. Every other process
serves ``/metrics`` through it too (``shoal.observe``). Tiny on purpose: stdlib asyncio only,
rendered on the event loop, so collectors read counters between two steps of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson

log = logging.getLogger(__name__)

_MAX_REQUEST: Final = 8192


def prometheus_text(
    metrics: list[tuple[str, str, str, dict[str, str], float | int | None]],
) -> bytes:
    """Render ``(name, type, help, labels, value)`` samples in the text exposition format."""
    lines: list[str] = []
    seen: set[str] = set()
    for name, kind, help_text, labels, value in metrics:
        if value is None:
            continue
        if name not in seen:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            seen.add(name)
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        lines.append(
            f"{name}{{{label_text}}} {float(value):.6g}"
            if label_text
            else f"{name} {float(value):.6g}"
        )
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsServer:
    """Serves the endpoints from callables that render the current state.

    ``render_metrics`` may return the bytes or an awaitable of them (a renderer that formats
    off the event loop). ``render_json`` None: no ``/api/v1/scaling`` (404). ``content_type``:
    of ``/metrics``.
    """

    def __init__(
        self,
        render_metrics: Callable[[], bytes | Awaitable[bytes]],
        render_json: Callable[[], dict[str, Any]] | None,
        host: str = "0.0.0.0",  # noqa: S104 - a metrics endpoint is meant to be scraped
        port: int = 9464,
        content_type: str = "text/plain; version=0.0.4",
    ) -> None:
        self.render_metrics = render_metrics
        self.render_json = render_json
        self.host = host
        self.port = port
        self.content_type = content_type
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Start listening; returns the port (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        sockets = self._server.sockets
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.port
        return self.port

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            writer.close()
            return
        request_line = head[:_MAX_REQUEST].split(b"\r\n", 1)[0].decode(errors="replace")
        parts = request_line.split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
        if len(parts) < 2 or parts[0] != "GET":
            status, body, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
        elif path == "/metrics":
            rendered = self.render_metrics()
            body = rendered if isinstance(rendered, bytes) else await rendered
            status, ctype = "200 OK", self.content_type
        elif path == "/api/v1/scaling" and self.render_json is not None:
            status, body, ctype = "200 OK", orjson.dumps(self.render_json()), "application/json"
        else:
            status, body, ctype = (
                "404 Not Found",
                b"try /metrics or /api/v1/scaling\n" if self.render_json else b"try /metrics\n",
                "text/plain",
            )
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
