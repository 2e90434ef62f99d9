"""``shoal view``'s web server: the page, its vendored libraries, and where to find the broker.

The page (``static/``) is served by the standard library's ``ThreadingHTTPServer`` in a
daemon thread; it connects by itself to the broker over MQTT/WebSockets (``mqtt.js``) and
draws with ``uPlot``, both vendored in ``static/vendor`` (``make view-assets``), so nothing
is fetched from the internet at run time. The only dynamic path is ``/config.json``: the
WebSocket URL, whether the page must ask for a user name and password, and the topic root.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final, Self

from shoal.errors import ConfigError

log = logging.getLogger(__name__)

STATIC: Final = Path(__file__).parent / "static"


@dataclass(frozen=True, slots=True)
class PageConfig:
    """What the page reads from ``/config.json``.

    Attributes:
        ws_url: the broker's MQTT-over-WebSockets endpoint (``ws://`` or ``wss://``); a
            loopback host is replaced by the host the page was loaded from.
        login: ask for a user name and password (profiles with access control).
        root: the topic root (``--topic-root``).
        username: a user name to offer in the login form (never a password).
    """

    ws_url: str
    login: bool = False
    root: str = ""
    username: str = ""


class _Handler(SimpleHTTPRequestHandler):
    """Static files from ``STATIC``, ``/config.json`` from the server's ``PageConfig``."""

    server_version = "shoal-view"
    config_body = b"{}"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/config.json":
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(self.config_body)))
            self.end_headers()
            self.wfile.write(self.config_body)
            return
        super().do_GET()

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        super().end_headers()

    def list_directory(self, path: str | Any) -> None:  # noqa: ARG002 - no listings
        self.send_error(HTTPStatus.NOT_FOUND)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("view %s: " + format, self.address_string(), *args)


class ViewServer:
    """Serves the page on ``bind:port`` (0: a free port) until ``close``.

    Example::

        with ViewServer(PageConfig(ws_url=broker.ws_url), port=8580) as view:
            print(view.url)
    """

    def __init__(self, config: PageConfig, *, bind: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        handler = type("Handler", (_Handler,), {"config_body": json.dumps(asdict(config)).encode()})
        try:
            self._server = ThreadingHTTPServer(
                (bind, port), partial(handler, directory=str(STATIC))
            )
        except OSError as exc:
            raise ConfigError(f"shoal view cannot listen on {bind}:{port}: {exc}") from exc
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port the page is served on."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The page's address (loopback when serving on every interface)."""
        host = str(self._server.server_address[0])
        if host in ("0.0.0.0", "", "::"):  # noqa: S104 - recognised, not bound
            host = "127.0.0.1"
        return f"http://{host}:{self.port}/"

    def start(self) -> Self:
        """Serve in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="shoal-view", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5.0)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
