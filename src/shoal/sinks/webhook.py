"""``shoal sink webhook``: POST each message of a topic to a URL, at least once.

The only module that speaks HTTP (the standard library's ``urllib``, on a worker thread, so
no HTTP framework is needed). Each MQTT message becomes one ``POST`` of its payload, as
published (JSON for alerts and, by default, window results), with these headers:

* ``Idempotency-Key``: the same for every copy of the same thing (``idempotency_key``), so
  the receiver can drop the duplicates at-least-once delivery brings;
* ``X-Shoal-Topic``: the MQTT topic; ``Content-Type``: the message's, else JSON or bytes.

A 2xx answer makes the message safe and it is acknowledged (``shoal.sinks.follow``).
Connection failures, time-outs, 408, 425, 429 and 5xx are retried on the same message with
exponential backoff (``Retry-After`` in seconds is honoured, up to the backoff's maximum),
for as long as it takes: nothing later is posted meanwhile, so the receiver sees messages in
their order. Any other answer (400, 401, 404, 3xx, ...) says the receiver will never take
this message: it is counted (``refused``, by status), logged with the status and skipped,
so one bad message cannot block every later alert.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import orjson

from shoal import __version__
from shoal.broker.session import Message
from shoal.errors import SchemaError, SinkError
from shoal.schemas.results import parse_window_message
from shoal.sinks.follow import Backoff

log = logging.getLogger(__name__)

RETRY_STATUSES: Final = frozenset({408, 425, 429})
"""Client-error statuses that mean "later", retried like 5xx."""

ALERT_IDENTITY: Final = ("pipeline", "alert", "key", "window", "start", "state")
"""Fields of an alert transition that identify it (the shape assumed until issue 16)."""


def idempotency_key(message: Message) -> str:
    """The same key for every copy of one thing, a different one for anything else.

    * a window result: ``result/<pipeline>/<window>/<start>/<partition>/<revision>/<rows>``,
      its copy identity (``WindowMessage.copy_key``): a combiner re-publishing a window
      after a restart sends the same identity and values (but a new ``emitted_at``); a part
      of a window split to fit the broker's packet limit adds its part:
      ``result/<pipeline>/<window>/<start>/<partition>/<revision>/part<part>/<rows>``
      (a whole window's key is unchanged);
    * an alert transition (a JSON object with ``alert`` and ``state``):
      ``alert/<pipeline>/<alert>/<key>/<window>/<start>/<state>``;
    * anything else: ``sha256/<hex>`` of the topic and payload.
    """
    payload = message.payload
    if payload[:1] == b"{" or message.content_type in ("application/msgpack",):
        try:
            window = parse_window_message(payload, message.content_type)
        except SchemaError:
            pass
        else:
            parts: tuple[object, ...] = ("result", *window.identity[:5])
            if window.parts > 1:
                parts = (*parts, f"part{window.part}")
            return "/".join(map(str, (*parts, window.rows)))
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and "alert" in body and "state" in body:
        return "/".join(["alert", *(str(body.get(name, "")) for name in ALERT_IDENTITY)])
    digest = hashlib.sha256(message.topic.encode() + b"\x00" + payload).hexdigest()
    return f"sha256/{digest}"


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Where and how to post.

    Attributes:
        url: the ``http://`` or ``https://`` URL to POST to.
        timeout_s: how long one request may take.
        retry: delays between attempts of one message.
        headers: extra headers for every request (an ``Authorization`` token, say).
    """

    url: str
    timeout_s: float = 10.0
    retry: Backoff = field(default_factory=lambda: Backoff(0.5, 60.0))
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        """Refuse URLs urllib would open as files or other schemes."""
        if not self.url.lower().startswith(("http://", "https://")):
            raise SinkError(f"web hook URL {self.url!r} must start with http:// or https://")


@dataclass
class WebhookStats:
    """What the web hook sink did (``--json``)."""

    messages: int = 0
    delivered: int = 0
    attempts: int = 0
    retries: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int | None  # None: no HTTP answer at all (connection failed, time-out)
    retry_after_s: float | None
    error: str


class WebhookSink:
    """A ``shoal.sinks.follow.Handler`` that POSTs each message (module docstring)."""

    def __init__(self, config: WebhookConfig) -> None:
        self.config = config
        self.stats = WebhookStats()

    async def handle(self, message: Message) -> None:
        """POST one message; returns after a 2xx or a refusal, retrying everything else."""
        self.stats.messages += 1
        key = idempotency_key(message)
        attempt = 0
        while True:
            self.stats.attempts += 1
            answer = await asyncio.to_thread(self._post, message, key)
            if answer.status is not None and 200 <= answer.status < 300:
                self.stats.delivered += 1
                return
            if answer.status is not None and not _retryable(answer.status):
                refused = self.stats.refused
                refused[str(answer.status)] = refused.get(str(answer.status), 0) + 1
                log.error(
                    "sink webhook: %s refused %s (%s): %s; skipped",
                    self.config.url,
                    key,
                    answer.status,
                    answer.error,
                )
                return
            attempt += 1
            self.stats.retries += 1
            self.stats.last_error = answer.error
            delay = self.config.retry.delay_s(attempt)
            if answer.retry_after_s is not None:
                delay = min(self.config.retry.max_s, max(delay, answer.retry_after_s))
            log.warning(
                "sink webhook: %s: %s; retrying %s in %.1f s",
                self.config.url,
                answer.error,
                key,
                delay,
            )
            await asyncio.sleep(delay)

    def _post(self, message: Message, key: str) -> _Answer:
        content_type = message.content_type or (
            "application/json"
            if message.payload[:1] in (b"{", b"[")
            else "application/octet-stream"
        )
        headers = {
            "Content-Type": content_type,
            "Idempotency-Key": key,
            "X-Shoal-Topic": message.topic,
            "User-Agent": f"shoal/{__version__}",
            **dict(self.config.headers),
        }
        request = urllib.request.Request(  # noqa: S310 - the scheme is checked in WebhookConfig
            self.config.url, data=message.payload, headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:  # noqa: S310
                response.read()
                return _Answer(int(response.status), None, "")
        except urllib.error.HTTPError as exc:
            return _Answer(
                exc.code, _retry_after(exc.headers.get("Retry-After")), f"HTTP {exc.code}"
            )
        except (urllib.error.URLError, OSError) as exc:
            return _Answer(None, None, str(getattr(exc, "reason", exc)))


def _retryable(status: int) -> bool:
    return status >= 500 or status in RETRY_STATUSES


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: our own backoff applies
