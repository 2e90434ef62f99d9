"""A tiny fake Kubernetes API server: the apps/v1 Deployment scale subresource, nothing else.

A real HTTP server on 127.0.0.1 (stdlib ``http.server`` in a thread) so the official client
runs its whole stack - URL building, serialisation, content types, error mapping - exactly as
against a cluster. It serves::

    GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   -> autoscaling/v1 Scale
    PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (merge, strategic merge or
                                                                    JSON patch, as the API does)

Unknown deployments give 404, verbs listed in ``forbidden`` give 403, other paths 404 and
other methods 405, all as ``Status`` objects like the API server's; ``delay_s`` slows every
answer down. Every request is recorded.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

_SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
_MERGE_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
_JSON_PATCH = "application/json-patch+json"


@dataclass
class FakeDeployment:
    """A Deployment's scale: what was asked (spec) and what runs (status)."""

    replicas: int
    status_replicas: int | None = None

    def scale(self, namespace: str, name: str) -> dict[str, Any]:
        """The autoscaling/v1 Scale object the API server returns."""
        spec: dict[str, Any] = {}
        if self.replicas:  # the API omits replicas: 0 (omitempty)
            spec["replicas"] = self.replicas
        status = self.replicas if self.status_replicas is None else self.status_replicas
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
            "spec": spec,
            "status": {"replicas": status, "selector": f"app.kubernetes.io/name={name}"},
        }


@dataclass(frozen=True)
class Recorded:
    """One request the server received."""

    method: str
    path: str
    content_type: str | None
    body: Any


@dataclass
class FakeKubernetes:
    """The server; ``deployments`` maps (namespace, name) to a ``FakeDeployment``."""

    deployments: dict[tuple[str, str], FakeDeployment] = field(default_factory=dict)
    forbidden: set[str] = field(default_factory=set)
    delay_s: float = 0.0
    requests: list[Recorded] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the server first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def patches(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "PATCH"]

    def start(self) -> Self:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_PATCH(self) -> None:
                fake._handle(self, "PATCH")

            def do_PUT(self) -> None:
                fake._handle(self, "PUT")

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the API ---------------------------------------------------------------------------

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = request.path.split("?", 1)[0]
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        content_type = request.headers.get("Content-Type")
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw.decode(errors="replace")
        self.requests.append(Recorded(method, path, content_type, body))
        time.sleep(self.delay_s)  # a slow or hung API server
        match = _SCALE_PATH.match(path)
        if match is None:
            _reply(request, _status(404, "NotFound", f"the server could not find {path}"))
            return
        namespace, name = match.groups()
        verb = {"GET": "get", "PATCH": "patch"}.get(method)
        if verb is None:
            _reply(request, _status(405, "MethodNotAllowed", f"{method} is not served here"))
            return
        if verb in self.forbidden:
            _reply(
                request,
                _status(
                    403,
                    "Forbidden",
                    f'deployments.apps "{name}" is forbidden: User "system:serviceaccount:'
                    f'{namespace}:shoal-scaler" cannot {verb} resource "deployments/scale" '
                    f'in API group "apps" in the namespace "{namespace}"',
                ),
            )
            return
        deployment = self.deployments.get((namespace, name))
        if deployment is None:
            _reply(request, _status(404, "NotFound", f'deployments.apps "{name}" not found'))
            return
        if verb == "patch":
            error = _apply_patch(deployment, content_type, body)
            if error is not None:
                _reply(request, error)
                return
        _reply(request, (200, deployment.scale(namespace, name)))


def _apply_patch(
    deployment: FakeDeployment, content_type: str | None, body: Any
) -> tuple[int, dict[str, Any]] | None:
    """Apply a patch of any kind the API server accepts; an error reply, or None."""
    media = (content_type or "").split(";", 1)[0].strip()
    if media in _MERGE_TYPES:
        if not isinstance(body, dict):
            return _status(400, "BadRequest", "a merge patch must be a JSON object")
        spec = body.get("spec") or {}
        if "replicas" in spec:
            deployment.replicas = int(spec["replicas"] or 0)
        return None
    if media == _JSON_PATCH:
        if not isinstance(body, list):
            return _status(
                400,
                "BadRequest",
                "json: cannot unmarshal object into Go value of type jsonpatch.Patch",
            )
        for op in body:
            if op.get("path") != "/spec/replicas" or op.get("op") not in ("add", "replace"):
                return _status(422, "Invalid", f"unsupported JSON patch operation {op!r}")
            deployment.replicas = int(op["value"])
        return None
    return _status(415, "UnsupportedMediaType", f"the body is {media or 'untyped'}")


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _reply(request: BaseHTTPRequestHandler, reply: tuple[int, dict[str, Any]]) -> None:
    code, payload = reply
    data = json.dumps(payload).encode()
    request.send_response(code)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(data)))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up
        request.end_headers()
        request.wfile.write(data)
