"""Every kind of message shoal publishes: its topic, syntax, QoS, retain flag and JSON Schema.

The table ``MESSAGES`` is the index of ``schemas/CONTRACT.md`` (§13) as data: a consumer
written in Python finds out what a message on a topic is with ``message_kind`` and validates
it against the named file in ``schemas/`` (MsgPack messages through ``json_view``). A test
keeps the table, the contract and the schema files in step, and another subscribes to a live
pipeline and fails on any message this table does not describe.

Imports nothing from shoal but ``schemas.topics``; never imports ``processors`` or ``broker``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgpack

from shoal.schemas.topics import Topics

Syntax = Literal["json", "msgpack", "batch"]
"""``json``: one JSON text; ``msgpack``: one MsgPack map; ``batch``: any batch encoding (§4)."""

ENCODED_WINDOW_SEGMENTS: Final = frozenset({"_json", "_msgpack"})
"""``results/<pipeline>/_<encoding>``: a window result in a pipeline's additional encoding."""


@dataclass(frozen=True, slots=True)
class MessageKind:
    """One kind of message shoal publishes.

    Attributes:
        name: the kind, as CONTRACT.md names it (``result-window``, ``late``, ...).
        topic: its topic below the deployment root, ``<placeholders>`` for names.
        syntax: how its payload is written.
        schema: the JSON Schema file in ``schemas/`` that describes it (MsgPack: its JSON
            view, see ``json_view``; batches: the JSON rows encoding).
        qos: the QoS it is published with.
        retain: whether it is published retained.
        content_type: the MQTT 5 content type it carries (None: none is set).
        publisher: who publishes it.
        internal: whether only shoal's own components read it (its format may change with
            its own version field, without a new wire-format version).
    """

    name: str
    topic: str
    syntax: Syntax
    schema: str
    qos: int
    retain: bool
    content_type: str | None
    publisher: str
    internal: bool = False


MESSAGES: Final[tuple[MessageKind, ...]] = (
    MessageKind(
        "batch",
        "ingest/<stream>/<gateway_id>",
        "batch",
        "batch.schema.json",
        1,
        False,
        "application/vnd.shoal.v1.*",
        "gateway",
    ),
    MessageKind(
        "gateway-status",
        "shoal/gateway/<gateway_id>",
        "json",
        "gateway-status.schema.json",
        1,
        True,
        None,
        "gateway",
    ),
    MessageKind(
        "confirm",
        "shoal/confirm/<gateway_id>/<pipeline>/<partition>",
        "json",
        "confirm.schema.json",
        1,
        True,
        None,
        "combiner",
    ),
    MessageKind(
        "result-window",
        "results/<pipeline>",
        "json",
        "result-window.schema.json",
        1,
        False,
        "application/json",
        "combiner",
    ),
    MessageKind(
        "result-window-columnar",
        "results/<pipeline>",
        "msgpack",
        "result-window-columnar.schema.json",
        1,
        False,
        "application/msgpack",
        "combiner",
    ),
    MessageKind(
        "result-key",
        "results/<pipeline>/<key>",
        "json",
        "result-key.schema.json",
        0,
        True,
        None,
        "combiner",
    ),
    MessageKind(
        "late",
        "shoal/late/<pipeline>",
        "json",
        "late.schema.json",
        1,
        False,
        "application/json",
        "combiner",
    ),
    MessageKind(
        "alert",
        "shoal/alerts/<pipeline>/<alert>/<key>",
        "json",
        "alert.schema.json",
        1,
        True,
        "application/json",
        "combiner",
    ),
    MessageKind(
        "deadletter",
        "shoal/deadletter/<pipeline>",
        "msgpack",
        "deadletter.schema.json",
        1,
        False,
        None,
        "worker",
    ),
    MessageKind(
        "metrics-worker",
        "shoal/metrics/worker/<worker_id>",
        "json",
        "metrics-worker.schema.json",
        0,
        False,
        None,
        "worker",
    ),
    MessageKind(
        "metrics-combiner",
        "shoal/metrics/combiner/<pipeline>-<partition>",
        "json",
        "metrics-combiner.schema.json",
        0,
        False,
        None,
        "combiner",
    ),
    MessageKind(
        "partial",
        "shoal/partials/<pipeline>/<partition>",
        "msgpack",
        "partial.schema.json",
        1,
        False,
        None,
        "worker",
        internal=True,
    ),
    MessageKind(
        "control",
        "shoal/control/<instance>",
        "json",
        "control.schema.json",
        1,
        False,
        None,
        "operators, a worker to itself, a combiner answering a flush",
        internal=True,
    ),
    MessageKind(
        "control",
        "shoal/control/combiners/<pipeline>",
        "json",
        "control.schema.json",
        1,
        False,
        None,
        "operators, shoal up, benchmarks",
        internal=True,
    ),
    MessageKind(
        "pipeline-document",
        "shoal/pipelines/<name>",
        "json",
        "pipeline-document.schema.json",
        1,
        True,
        None,
        "control plane",
    ),
    MessageKind(
        "pipeline-request",
        "shoal/pipelines/_request/<client>",
        "json",
        "pipeline-request.schema.json",
        1,
        False,
        None,
        "shoal pipeline (admin)",
    ),
    MessageKind(
        "pipeline-result",
        "shoal/pipelines/_reply/<client>",
        "json",
        "pipeline-result.schema.json",
        1,
        False,
        None,
        "control plane",
    ),
    MessageKind(
        "combiner-announcement",
        "shoal/combiners/<id>",
        "json",
        "combiner-announcement.schema.json",
        1,
        True,
        None,
        "pool combiner (its will: the broker)",
    ),
)
"""Every kind of message, in the order of CONTRACT.md's index (``control`` has two topics)."""


def message_kind(topics: Topics, topic: str, payload: bytes = b"") -> MessageKind | None:
    """The kind of the message shoal published on ``topic``, or None if shoal publishes none.

    ``payload`` tells a JSON window result from a MsgPack one: ``results/<pipeline>`` carries
    the pipeline's first output encoding, and JSON text starts with ``{`` (CONTRACT.md §6).
    """
    prefix = topics.under_root("")
    if not topic.startswith(prefix):
        return None
    parts = topic[len(prefix) :].split("/")
    if not all(parts):
        return None
    if parts[0] == "results" and (
        len(parts) == 2 or (len(parts) == 3 and parts[2] in ENCODED_WINDOW_SEGMENTS)
    ):
        json_text = payload[:1] in (b"{", b" ", b"\t", b"\n", b"\r")
        name = "result-window" if json_text else "result-window-columnar"
        return next(m for m in MESSAGES if m.name == name)
    for kind in MESSAGES:
        pattern = kind.topic.split("/")
        if len(pattern) == len(parts) and all(
            p.startswith("<") or p == part for p, part in zip(pattern, parts, strict=True)
        ):
            return kind
    return None


def json_view(payload: bytes) -> Any:
    """A MsgPack message as the JSON value its schema describes.

    Maps become objects, arrays arrays, nil null; ``bin`` values become base64 strings
    (RFC 4648 with padding; the schemas mark them ``"contentEncoding": "base64"``).
    """
    return _view(msgpack.unpackb(payload, raw=False, strict_map_key=True))


def _view(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _view(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_view(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return value
