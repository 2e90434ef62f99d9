"""Device payloads to measurement rows: JSON objects, JSON arrays of objects, raw values.

``Decoder.decode`` turns one device message into rows ``(sensor_id, ts, value, name, type,
unit)`` or raises a ``DecodeError``/``SchemaError`` that says which format was assumed, what
was expected, what was found and where (topic, field, element, byte offset). It is total:
any bytes give rows or a typed error, never another exception (the fuzz test holds it to
that). Sparkplug B, which needs state across messages, is ``shoal.adapters.sparkplug``.

Pure: no I/O, no clock of its own (the caller passes the arrival time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final

import orjson

from shoal.adapters.mapping import FIELD_LEVEL, Route, Template
from shoal.errors import DecodeError, InputError, SchemaError
from shoal.schemas import DEFAULT_LIMITS, MAX_TS_MS, MIN_TS_MS
from shoal.schemas._json import json_error

Row = tuple[str, int, float, str | None, str | None, str | None]
"""One measurement: sensor id, event time (epoch ms), value, name, type, unit."""

Label = tuple[str, str | None, str | None, str | None]
"""What a metric on a topic is called: sensor id, name, type, unit."""

_MISSING: Final = object()

_MAX_FOUND: Final = 60
"""Characters of a found value quoted in a reason."""

_CACHE_LIMIT: Final = 200_000
"""Rendered templates kept per decoder (per topic and metric); cleared when exceeded."""


def quote(value: Any) -> str:
    """A short description of a found value, for reasons: its JSON type and its text."""
    kind = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    text = repr(value) if not isinstance(value, list | dict) else orjson.dumps(value).decode()
    if len(text) > _MAX_FOUND:
        text = text[:_MAX_FOUND] + "..."
    return f"{kind} {text}"


class Decoder:
    """Decodes the messages of one route; keeps rendered templates per topic and metric.

    Args:
        route: the mapping's route the messages matched.
        max_future_ms: refuse rows this far ahead of the arrival time (None: no check).
        max_string_bytes: longest sensor id or attribute (the wire contract's limit).
    """

    def __init__(
        self,
        route: Route,
        *,
        max_future_ms: int | None = DEFAULT_LIMITS.max_future_ms,
        max_string_bytes: int = DEFAULT_LIMITS.max_string_bytes,
    ) -> None:
        self.route = route
        self.max_future_ms = max_future_ms
        self.max_string_bytes = max_string_bytes
        self._labels: dict[tuple[str, str], Label] = {}
        self._topic_labels: dict[str, dict[str, Label]] = {}  # the same, by topic then field
        self._ts_field = route.timestamp.field if route.timestamp.source == "payload" else None
        self._skip = {f for f in (self._ts_field, route.message_id) if f is not None}
        self._parse_ts = _TS_PARSERS[route.timestamp.unit]
        self.format = route.format

    def take_commands(self) -> list[tuple[str, bytes]]:
        """Messages to publish to devices: none for JSON and raw (Sparkplug overrides)."""
        return []

    def take_refusals(self) -> list[InputError]:
        """Parts of the last message refused: none for JSON and raw (Sparkplug overrides)."""
        return []

    def where(self, topic: str) -> str:
        """The words naming the assumed format and the topic, for reasons."""
        route = self.route
        return f"{self.format} payload on {topic!r} (route {route.index}: {route.topic.text})"

    # -- the formats --------------------------------------------------------------------------

    def decode(self, topic: str, levels: dict[str, str], payload: bytes, now_ms: int) -> list[Row]:
        """The rows of one message.

        Raises:
            DecodeError: the payload is not what the route's format expects.
            SchemaError: it is, but a value breaks the wire contract (not finite, a timestamp
                out of range, a string too long).
        """
        if self.format == "raw":
            return self._raw(topic, levels, payload, now_ms)
        body = self._json(topic, payload)
        if self.format == "json-object":
            if not isinstance(body, dict):
                raise DecodeError(
                    f"{self.where(topic)}: not a JSON object",
                    reason="not_an_object",
                    expected='one JSON object such as {"temp": 21.5}',
                    found=quote(body),
                )
            return self._object(topic, levels, body, now_ms, None)
        if not isinstance(body, list):
            raise DecodeError(
                f"{self.where(topic)}: not a JSON array",
                reason="not_an_array",
                expected='a JSON array of objects such as [{"temp": 21.5}]',
                found=quote(body),
            )
        rows: list[Row] = []
        for element, item in enumerate(body):
            if not isinstance(item, dict):
                raise DecodeError(
                    f"{self.where(topic)}: element {element} is not a JSON object",
                    reason="not_an_object",
                    row=element,
                    expected="a JSON object",
                    found=quote(item),
                )
            rows.extend(self._object(topic, levels, item, now_ms, element))
        if not rows:
            raise DecodeError(
                f"{self.where(topic)}: no measurements",
                reason="no_metrics",
                expected="at least one object with a number field",
                found="an empty array" if not body else "objects without number fields",
            )
        return rows

    def _json(self, topic: str, payload: bytes) -> Any:
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            # The worker's reading of orjson's refusal: its ``pos`` counts characters, not
            # bytes, and is 0 for text that is not UTF-8.
            at = json_error(payload, exc)
            offset = at.offset or 0
            raise DecodeError(
                f"{self.where(topic)}: not valid JSON at byte {offset} "
                f"(line {at.line}, column {at.column}): {exc.msg}",
                reason="not_json",
                expected="UTF-8 JSON text",
                found=_bytes_near(payload, offset),
                offset=offset,
            ) from None

    def _raw(self, topic: str, levels: dict[str, str], payload: bytes, now_ms: int) -> list[Row]:
        try:
            text = payload.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise DecodeError(
                f"{self.where(topic)}: not UTF-8 text "
                f"(byte {exc.start} is 0x{payload[exc.start]:02x})",
                reason="not_utf8",
                field=f"byte {exc.start}",
                expected="a number written as text, such as 21.5",
                found=_bytes_near(payload, exc.start),
            ) from None
        value: float
        if text in ("true", "false"):
            value = 1.0 if text == "true" else 0.0
        else:
            try:
                value = float(text)
            except ValueError:
                raise DecodeError(
                    f"{self.where(topic)}: not a number",
                    reason="string_metric" if text else "empty_payload",
                    expected="a number written as text, such as 21.5 (or true/false)",
                    found=f"text {text[:_MAX_FOUND]!r}" if text else "an empty payload",
                ) from None
        self._check_value(topic, value, None, None)
        sensor_id, name, kind, unit = self.label(topic, levels, topic.rsplit("/", 1)[-1])
        return [(sensor_id, now_ms, value, name, kind, unit)]

    def _object(
        self,
        topic: str,
        levels: dict[str, str],
        body: dict[str, Any],
        now_ms: int,
        element: int | None,
    ) -> list[Row]:
        ts = self._timestamp(topic, body, now_ms, element)
        route = self.route
        names = route.fields or tuple(k for k in body if k not in self._skip)
        rows: list[Row] = []
        labels = self._topic_labels.get(topic)
        if labels is None:
            if len(self._topic_labels) >= _CACHE_LIMIT:
                self._topic_labels.clear()
            labels = self._topic_labels[topic] = {}
        for field in names:
            raw = body.get(field, _MISSING)
            kind = type(raw)
            # The common case first, without a call: a finite number whose labels are known.
            if kind is float or kind is int:
                value = float(raw)
                label = labels.get(field)
                if label is not None and value - value == 0.0:
                    rows.append((label[0], ts, value, label[1], label[2], label[3]))
                    continue
            elif raw is _MISSING:
                continue  # a device need not send every field every time
            elif kind is bool:
                value = 1.0 if raw else 0.0
            elif kind is str and route.strings == "skip":
                continue
            else:
                reason = {str: "string_metric", type(None): "null_metric"}.get(
                    type(raw), "nested_metric"
                )
                raise DecodeError(
                    f"{self.where(topic)}: field {field!r} is not a number"
                    + (f" in element {element}" if element is not None else "")
                    + (
                        " (set strings = 'skip' in the route to leave text fields out)"
                        if reason == "string_metric"
                        else ""
                    ),
                    reason=reason,
                    field=field,
                    row=element,
                    expected="a number or a boolean",
                    found=quote(raw),
                )
            self._check_value(topic, value, field, element)
            label = labels[field] = self.label(topic, levels, field)
            rows.append((label[0], ts, value, label[1], label[2], label[3]))
        if not rows and element is None:
            raise DecodeError(
                f"{self.where(topic)}: no measurements",
                reason="no_metrics",
                expected=(
                    f"one of the fields {list(route.fields)}"
                    if route.fields
                    else "at least one field with a number"
                ),
                found=f"fields {list(body)[:10]}" if body else "an empty object",
            )
        return rows

    # -- pieces -----------------------------------------------------------------------------

    def _timestamp(self, topic: str, body: dict[str, Any], now_ms: int, element: int | None) -> int:
        field = self._ts_field
        if field is None:
            return now_ms
        if field not in body:
            raise DecodeError(
                f"{self.where(topic)}: the timestamp field {field!r} is missing"
                + (f" in element {element}" if element is not None else ""),
                reason="missing_timestamp",
                field=field,
                row=element,
                expected=f"a timestamp in {self.route.timestamp.unit}",
                found=f"fields {list(body)[:10]}",
            )
        ts = self._parse_ts(body[field])
        if ts is None:
            raise DecodeError(
                f"{self.where(topic)}: the timestamp field {field!r} cannot be read as "
                f"{_UNIT_WORDS[self.route.timestamp.unit]}",
                reason="bad_timestamp",
                field=field,
                row=element,
                expected=_UNIT_WORDS[self.route.timestamp.unit],
                found=quote(body[field]),
            )
        return self.check_ts(topic, ts, now_ms, field, element)

    def check_ts(self, topic: str, ts: int, now_ms: int, field: str, element: int | None) -> int:
        """``ts`` if the wire contract takes it (in range, not too far ahead).

        Raises:
            SchemaError: it is out of range or too far in the future.
        """
        high = MAX_TS_MS
        if self.max_future_ms is not None:
            high = min(high, now_ms + self.max_future_ms)
        if not MIN_TS_MS <= ts <= high:
            raise SchemaError(
                f"{self.where(topic)}: timestamp out of range",
                reason="out_of_range" if not MIN_TS_MS <= ts <= MAX_TS_MS else "ts_in_future",
                field=field,
                row=element,
                expected=f"epoch milliseconds in [{MIN_TS_MS}, {high}] (at most "
                f"{self.max_future_ms} ms after the adapter's clock)",
                found=str(ts),
            )
        return ts

    def _check_value(
        self, topic: str, value: float, field: str | None, element: int | None
    ) -> None:
        if not math.isfinite(value):
            raise SchemaError(
                f"{self.where(topic)}: value is not finite",
                reason="not_finite",
                field=field or "value",
                row=element,
                expected="a finite number",
                found=repr(value),
            )

    def label(self, topic: str, levels: dict[str, str], metric: str) -> Label:
        """Sensor id, name, type and unit of ``metric`` on ``topic`` (rendered once, cached).

        Raises:
            SchemaError: one of them is empty or longer than the wire contract allows.
        """
        key = (topic, metric)
        hit = self._labels.get(key)
        if hit is not None:
            return hit
        values = {**levels, FIELD_LEVEL: metric}
        route = self.route
        unit = route.units.get(metric) if route.units else None
        label = (
            self._render(topic, route.sensor_id, values, "sensor_id"),
            self._maybe(topic, route.name, values, "name"),
            self._maybe(topic, route.type, values, "type"),
            unit if unit is not None else self._maybe(topic, route.unit, values, "unit"),
        )
        if len(self._labels) >= _CACHE_LIMIT:
            self._labels.clear()
        self._labels[key] = label
        return label

    def _maybe(
        self, topic: str, template: Template | None, values: dict[str, str], what: str
    ) -> str | None:
        return None if template is None else self._render(topic, template, values, what)

    def _render(self, topic: str, template: Template, values: dict[str, str], what: str) -> str:
        text = template.render(values)
        size = len(text.encode("utf-8", "surrogatepass"))
        if not text or size > self.max_string_bytes:
            raise SchemaError(
                f"{self.where(topic)}: the {what} made from {template.text!r} is "
                + ("empty" if not text else f"{size} bytes long"),
                reason="empty_string" if not text else "string_too_long",
                field=what,
                expected=f"1 to {self.max_string_bytes} UTF-8 bytes",
                found=repr(text[:_MAX_FOUND]),
            )
        return text


def _bytes_near(payload: bytes, offset: int) -> str:
    start = max(0, offset - 8)
    chunk = payload[start : offset + 8]
    return f"bytes {chunk!r} around offset {offset} of {len(payload)}"


def _epoch(scale: float) -> Callable[[Any], int | None]:
    def parse(value: Any) -> int | None:
        if type(value) is int and scale == 1.0:  # epoch ms as an integer: the usual clock
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if not math.isfinite(value) or abs(value) > 1e300:
            return None
        if isinstance(value, int) and scale == 1.0:
            return value
        return round(value * scale)

    return parse


def _iso(value: Any) -> int | None:
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None  # a time without a zone means a different instant on every device
    try:
        return int(parsed.timestamp() * 1000)
    except (OverflowError, OSError, ValueError):
        return None


def _us(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value) // 1000 if isinstance(value, int) else int(value // 1000)


_TS_PARSERS: Final[dict[str, Callable[[Any], int | None]]] = {
    "s": _epoch(1000.0),
    "ms": _epoch(1.0),
    "us": _us,
    "iso8601": _iso,
}

_UNIT_WORDS: Final = {
    "s": "epoch seconds (a number)",
    "ms": "epoch milliseconds (a number)",
    "us": "epoch microseconds (a number)",
    "iso8601": "ISO-8601 text with a time zone, such as 2024-05-01T12:00:00.123Z",
}
