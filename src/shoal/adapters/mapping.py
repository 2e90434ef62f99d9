"""Adapter mappings: which device topics to read and how their payloads become measurements.

A mapping is a TOML file, parsed once here into frozen dataclasses (``parse_mapping``,
``load_mapping``); every refusal is a ``ConfigError`` whose ``field`` is the setting's path
(``routes[0].timestamp.unit``). Example (``mappings/json-sensors.toml``)::

    name = "sensors"          # dead letters go to shoal/deadletter/<name>
    stream = "devices"        # batches go to ingest/<stream>/<adapter id>

    [batching]
    max_rows = 10000
    max_delay_ms = 200

    [[routes]]
    topic = "sensors/{site}/{device}"
    format = "json-object"
    sensor_id = "{site}.{device}"
    name = "{field}"
    fields = ["temp", "hum"]
    timestamp = { field = "ts", unit = "ms" }
    units = { temp = "C", hum = "%" }

Never imports ``shoal.broker`` or the MQTT libraries: a mapping is data.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shoal.adapters._table import Table
from shoal.errors import ConfigError
from shoal.schemas import ATTRIBUTE_COLUMNS, DEFAULT_LIMITS

FORMATS: Final = ("json-object", "json-array", "raw", "sparkplug")
"""Payload formats a route can read."""

TIME_UNITS: Final = ("s", "ms", "us", "iso8601")
"""How a payload timestamp field is written."""

TIME_SOURCES: Final = ("payload", "arrival")
"""Where a row's event time comes from."""

SPARKPLUG_DEVICE: Final = "device"
"""The template name of a Sparkplug device id (``node`` for a node's own metrics)."""

FIELD_LEVEL: Final = "field"
"""The template name that stands for the metric: a JSON field name, a Sparkplug metric name."""

_LEVEL = re.compile(r"^\{([A-Za-z_][A-Za-z0-9_]*)\}$")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_MAX_ROWS_PER_BATCH: Final = 50_000
"""Adapter batches stay well inside one gateway batch and one packet (never split in two)."""


@dataclass(frozen=True, slots=True)
class TopicPattern:
    """A topic with named levels, ``sensors/{site}/{device}``; ``+`` and ``#`` as in MQTT.

    Attributes:
        text: the pattern as written.
        levels: per topic level, the name it binds (``None``: a literal, ``+`` or ``#``).
        literals: per topic level, the literal it must equal (``None``: any).
        multi: the pattern ends in ``#`` (any number of further levels).
    """

    text: str
    levels: tuple[str | None, ...]
    literals: tuple[str | None, ...]
    multi: bool

    @property
    def filter(self) -> str:
        """The MQTT subscription filter: every named level becomes ``+``."""
        parts = [
            "+" if name is not None else (lit or "+")
            for name, lit in zip(self.levels, self.literals, strict=True)
        ]
        return "/".join([*parts, "#"] if self.multi else parts)

    def match(self, topic: str) -> dict[str, str] | None:
        """The named levels of ``topic``, or None when the topic does not fit the pattern."""
        parts = topic.split("/")
        if len(parts) < len(self.levels) or (len(parts) > len(self.levels) and not self.multi):
            return None
        bound: dict[str, str] = {}
        for part, name, literal in zip(parts, self.levels, self.literals, strict=False):
            if literal is not None and part != literal:
                return None
            if name is not None:
                bound[name] = part
        return bound


@dataclass(frozen=True, slots=True)
class Template:
    """A string with ``{name}`` placeholders filled from topic levels and ``{field}``.

    Attributes:
        text: as written.
        names: the placeholders, in order.
    """

    text: str
    names: tuple[str, ...]

    def render(self, values: dict[str, str]) -> str:
        """The text with every placeholder replaced (all names must be in ``values``)."""
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.text)


@dataclass(frozen=True, slots=True)
class TimestampSpec:
    """Where a row's event time comes from.

    Attributes:
        source: ``payload`` (a field of the payload) or ``arrival`` (the adapter's clock).
        field: the payload field (``payload`` only).
        unit: how that field is written: epoch ``s``/``ms``/``us`` or ``iso8601`` text.
    """

    source: str = "arrival"
    field: str | None = None
    unit: str = "ms"


@dataclass(frozen=True, slots=True)
class Route:
    """One kind of device message: a topic pattern, its payload format, how rows are made.

    Attributes:
        topic: the topic pattern (named levels feed the templates).
        format: one of ``FORMATS``.
        sensor_id: template for the row's sensor id (the usual pipeline key).
        name, type, unit: templates for the row's attributes (None: no attribute).
        fields: JSON formats: the fields that hold measurements (empty: every field with a
            number or boolean, except the timestamp and message id fields).
        units: per metric unit, overriding ``unit``.
        timestamp: where event time comes from.
        message_id: a payload field that identifies a device message; with it the adapter
            drops a message whose (topic, id) it has taken recently (device re-sends).
        strings: ``dead-letter`` (default) refuses a message whose metric is a string;
            ``skip`` leaves such metrics out and keeps the others.
        index: the route's position in the mapping (for messages and field paths).
    """

    topic: TopicPattern
    format: str
    sensor_id: Template
    name: Template | None
    type: Template | None
    unit: Template | None
    fields: tuple[str, ...]
    units: dict[str, str]
    timestamp: TimestampSpec
    message_id: str | None
    strings: str
    index: int


@dataclass(frozen=True, slots=True)
class Batching:
    """When the adapter seals the rows it holds into a batch (and only then acknowledges).

    Attributes:
        max_rows: seal once this many rows wait.
        max_delay_ms: seal once the oldest waiting message is this old.
        max_messages: the MQTT Receive Maximum the adapter announces: device messages in
            flight to it unacknowledged, at most (Mosquitto honours an MQTT 5 client's value
            above its own ``max_inflight_messages``). Messages are logged and acknowledged
            per read of the socket, and at the latest when this many wait. It is also how
            many messages a returning adapter may get before the broker's reply to its
            SUBSCRIBE (they come first), so keep it to what a read of the socket brings.
        stall_ms: log and acknowledge a lone message once no other arrived for this long
            (a read that brought one message; sessions that hand over one message at a time).
    """

    max_rows: int = 10_000
    max_delay_ms: int = 200
    max_messages: int = 1_000
    stall_ms: int = 2


@dataclass(frozen=True, slots=True)
class Mapping:
    """A whole mapping file.

    Attributes:
        name: names the adapter's dead-letter topic (``shoal/deadletter/<name>``) and default
            shared-subscription group.
        stream: the shoal stream its batches go to.
        group: the MQTT shared-subscription group adapters of this mapping join.
        routes: the device message kinds, tried in order; the first that matches a topic wins.
        batching: when batches are sealed.
        max_future_ms: refuse rows whose event time is this far ahead of the adapter's clock
            (the workers' limit by default); None: no check.
        sparkplug_rebirth: ask a Sparkplug node to rebirth (NCMD) on a seq gap or data
            before birth.
    """

    name: str
    stream: str
    group: str
    routes: tuple[Route, ...]
    batching: Batching
    max_future_ms: int | None
    sparkplug_rebirth: bool = True

    def route_for(self, topic: str) -> tuple[Route, dict[str, str]] | None:
        """The first route whose pattern matches ``topic``, with its bound levels."""
        for route in self.routes:
            levels = route.topic.match(topic)
            if levels is not None:
                return route, levels
        return None

    @property
    def filters(self) -> tuple[str, ...]:
        """The subscription filters, one per distinct route pattern."""
        return tuple(dict.fromkeys(r.topic.filter for r in self.routes))

    @property
    def subscriptions(self) -> list[str]:
        """What an adapter subscribes to: shared for stateless formats; Sparkplug plain.

        A Sparkplug host must see every message of a node, in order (births define the
        aliases that data uses, seq numbers run per node): round-robin sharing would split
        them. Several adapters split Sparkplug traffic by namespace or mapping instead.
        """
        shared = [
            f"$share/{self.group}/{r.topic.filter}" for r in self.routes if r.format != "sparkplug"
        ]
        plain = [r.topic.filter for r in self.routes if r.format == "sparkplug"]
        return list(dict.fromkeys([*shared, *plain]))


def load_mapping(path: Path) -> Mapping:
    """Read and validate a mapping file.

    Raises:
        ConfigError: the file is missing, not TOML, or a setting is wrong (``field`` names it).
    """
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read mapping {path}: {exc.strerror}", field=None) from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"mapping {path} is not valid TOML: {exc}", reason="not_toml") from exc
    return parse_mapping(raw, where=str(path))


def parse_mapping(raw: dict[str, Any], *, where: str = "mapping") -> Mapping:
    """Validate a parsed TOML document as a mapping.

    Raises:
        ConfigError: a setting is missing or wrong; ``field`` is its path.
    """
    top = Table(raw, "", where)
    name = top.segment("name", default="adapter")
    stream = top.segment("stream", default="devices")
    group = top.segment("group", default=f"shoal-adapt-{name}")
    future = top.integer_or_none("max_future_ms", default=DEFAULT_LIMITS.max_future_ms)
    rebirth = top.boolean("sparkplug_rebirth", default=True)
    batching = _batching(top.table("batching"))
    tables = top.tables("routes")
    if not tables:
        raise top.error("routes", "a mapping needs at least one [[routes]] table")
    routes = tuple(_route(t, i) for i, t in enumerate(tables))
    top.finish()
    return Mapping(name, stream, group, routes, batching, future, rebirth)


def _batching(table: Table) -> Batching:
    default = Batching()
    batching = Batching(
        max_rows=table.integer(
            "max_rows", default=default.max_rows, low=1, high=_MAX_ROWS_PER_BATCH
        ),
        max_delay_ms=table.integer(
            "max_delay_ms", default=default.max_delay_ms, low=1, high=60_000
        ),
        max_messages=table.integer(
            "max_messages", default=default.max_messages, low=1, high=20_000
        ),
        stall_ms=table.integer("stall_ms", default=default.stall_ms, low=1, high=60_000),
    )
    table.finish()
    return batching


def _route(table: Table, index: int) -> Route:
    fmt = table.choice("format", FORMATS, default=None)
    pattern = _sparkplug_pattern(table) if fmt == "sparkplug" else _pattern(table)
    bound = {n for n in pattern.levels if n is not None}
    known = bound | {FIELD_LEVEL}
    if fmt == "sparkplug":
        known.add(SPARKPLUG_DEVICE)
        default_id: str | None = "{group}.{node}.{device}"
    else:
        default_id = ".".join(f"{{{n}}}" for n in pattern.levels if n is not None) or None
    sensor_id = _template(table, "sensor_id", known, default=default_id)
    if sensor_id is None:
        raise table.error(
            "sensor_id",
            "the topic has no named level, so sensor_id must be given (a template such as "
            "'{device}' or a fixed name)",
        )
    default_name = "{field}" if fmt != "raw" else None
    attrs = {
        a: _template(table, a, known, default=default_name if a == "name" else None)
        for a in ATTRIBUTE_COLUMNS
    }
    fields = table.strings("fields", default=())
    units = table.string_map("units")
    timestamp = _timestamp(table.table("timestamp"), fmt)
    message_id = table.string_or_none("message_id")
    if fmt in ("raw", "sparkplug") and message_id is not None:
        raise table.error("message_id", f"message_id applies to JSON formats, not {fmt!r}")
    if fmt == "raw" and fields:
        raise table.error("fields", "a raw payload has no fields to select")
    strings = table.choice("strings", ("dead-letter", "skip"), default="dead-letter")
    table.finish()
    return Route(
        topic=pattern,
        format=fmt,
        sensor_id=sensor_id,
        name=attrs["name"],
        type=attrs["type"],
        unit=attrs["unit"],
        fields=fields,
        units=units,
        timestamp=timestamp,
        message_id=message_id,
        strings=strings,
        index=index,
    )


def _pattern(table: Table) -> TopicPattern:
    text = table.string("topic")
    parts = text.split("/")
    levels: list[str | None] = []
    literals: list[str | None] = []
    multi = False
    for position, part in enumerate(parts):
        named = _LEVEL.match(part)
        if part == "#":
            if position != len(parts) - 1:
                raise table.error("topic", f"'#' must be the last level of {text!r}")
            multi = True
        elif named:
            if named.group(1) in levels or named.group(1) == FIELD_LEVEL:
                raise table.error(
                    "topic", f"level name {named.group(1)!r} is used twice or reserved in {text!r}"
                )
            levels.append(named.group(1))
            literals.append(None)
        elif part == "+":
            levels.append(None)
            literals.append(None)
        elif not part or any(c in part for c in "+#{}"):
            raise table.error(
                "topic",
                f"level {position} of {text!r} is {part!r}: expected a literal, '+', '#' or "
                "'{name}' (a whole level)",
            )
        else:
            levels.append(None)
            literals.append(part)
    if text.startswith("$"):
        raise table.error("topic", f"{text!r}: adapters do not read $-topics")
    return TopicPattern(text, tuple(levels), tuple(literals), multi)


def _sparkplug_pattern(table: Table) -> TopicPattern:
    """``<namespace>/<group>/<type>/<node>/#``: the route's topic is the namespace."""
    text = table.string("topic")
    parts = text.split("/")
    if any(not p or any(c in p for c in "+#{}") for p in parts) or text.startswith("$"):
        raise table.error(
            "topic",
            f"{text!r}: a Sparkplug route's topic is its namespace, literal levels such as "
            "'spBv1.0' (group, message type, node and device follow it)",
        )
    levels = (*([None] * len(parts)), "group", "message_type", "node")
    literals = (*parts, None, None, None)
    return TopicPattern(text, levels, literals, multi=True)


def _timestamp(table: Table, fmt: str | None) -> TimestampSpec:
    field = table.string_or_none("field")
    carried = field is not None or fmt == "sparkplug"  # Sparkplug metrics carry their time
    source = table.choice("source", TIME_SOURCES, default="payload" if carried else "arrival")
    unit = table.choice("unit", TIME_UNITS, default="ms")
    table.finish()
    if source == "payload" and fmt == "raw":
        raise table.error("source", "a raw payload has no timestamp field: use source='arrival'")
    if source == "payload" and fmt == "sparkplug":
        field = field or "timestamp"  # Sparkplug carries its own (ms) timestamps
    if source == "payload" and field is None:
        raise table.error("field", "source='payload' needs the timestamp field's name")
    return TimestampSpec(source, field if source == "payload" else None, unit)


def _template(table: Table, key: str, known: set[str], *, default: str | None) -> Template | None:
    """The template setting ``key``; its placeholders must be in ``known``."""
    text = table.string_or_none(key) or default
    if text is None:
        return None
    names = tuple(_PLACEHOLDER.findall(text))
    for name in names:
        if name not in known:
            raise table.error(
                key,
                f"{text!r} uses {{{name}}}, which is neither a named level of the topic "
                f"nor {{{FIELD_LEVEL}}} (known: {sorted(known)})",
            )
    if "{" in _PLACEHOLDER.sub("", text) or "}" in _PLACEHOLDER.sub("", text):
        raise table.error(key, f"{text!r} has an unmatched brace")
    return Template(text, names)
