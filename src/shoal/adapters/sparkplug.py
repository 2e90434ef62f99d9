"""Sparkplug B (v3.0) device messages to rows: births, aliases, deaths, seq gaps, rebirth.

Topics are ``<namespace>/<group>/<type>/<node>[/<device>]`` (the route's ``topic`` is the
namespace, ``spBv1.0``): the device level is there for device messages (``D...``) only, and
no level is empty. Payloads are decoded with the official ``sparkplug_b.proto``
(``shoal.adapters._proto``) through ``protobuf``. Per edge node the decoder keeps what the
specification asks a host application to keep:

* ``NBIRTH``: the node's metric aliases and datatypes, its ``bdSeq`` and the message ``seq``
  (0-255, one counter per node over its node and device messages); ``DBIRTH``: a device's
  aliases. Birth certificates carry current values: numeric ones become rows too.
* ``NDATA``/``DDATA``: metrics by alias (or name), values by the datatype the birth declared.
  Data from a node that has not been born (the adapter started after the birth, or the birth
  went to another member) and a ``seq`` that skips are answered with a rebirth request:
  ``NCMD`` to ``<namespace>/<group>/NCMD/<node>`` with the boolean metric
  ``Node Control/Rebirth`` = true (at most once per ``REBIRTH_EVERY_MS`` per node). Data that
  cannot be resolved (no birth, an unknown alias) is refused with that reason.
* ``NDEATH`` (with the birth's ``bdSeq``; a stale one from an older connection is ignored)
  forgets the node and its devices; ``DDEATH`` forgets a device.

Datatypes: integers (signed ones are two's complement in the proto's unsigned fields),
floats, doubles and booleans (1.0/0.0) become values. Strings, text, UUIDs, date-times,
bytes, files, data sets, templates and arrays are refused with reason ``string_metric`` or
``unsupported_datatype`` (a dead letter naming the metric) unless the route says
``strings = "skip"``; the message's numeric metrics are kept either way. Null metrics carry
no reading and are left out. ``bdSeq`` and ``Node Control/*``/``Device Control/*`` metrics are
bookkeeping, not readings.

Cost: protobuf's C runtime (upb) parses the payload; what is left in Python is a handful of
field reads per metric. What can be worked out once is: per topic its parts, template values
and rendered labels (``_Place``); per birth, for each alias, the metric's name, datatype and
whether it is a reading (``_Declared``); per (value field, datatype) the conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from google.protobuf.message import DecodeError as ProtobufDecodeError

from shoal.adapters._proto import sparkplug_b_pb2 as pb
from shoal.adapters.decode import Decoder, Label, Row
from shoal.adapters.mapping import Route
from shoal.errors import DecodeError, InputError, SchemaError
from shoal.schemas import DEFAULT_LIMITS, MAX_TS_MS, MIN_TS_MS

REBIRTH_METRIC: Final = "Node Control/Rebirth"
REBIRTH_EVERY_MS: Final = 5_000
"""A node is asked to rebirth at most this often (its birth may take a moment to arrive)."""

NODE_DEVICE: Final = "node"
"""``{device}`` of a node's own metrics (NBIRTH/NDATA), which have no device id."""

_TYPES: Final = ("NBIRTH", "NDEATH", "DBIRTH", "DDEATH", "NDATA", "DDATA", "NCMD", "DCMD")
_SIGNED_32: Final = {pb.Int8, pb.Int16, pb.Int32}
_UNSIGNED_32: Final = {pb.UInt8, pb.UInt16, pb.UInt32}
_STRINGS: Final = {pb.String, pb.Text, pb.UUID}
_BOOKKEEPING: Final = ("Node Control/", "Device Control/")
_NUMERIC: Final = {*_SIGNED_32, *_UNSIGNED_32, pb.Int64, pb.UInt64, pb.Float, pb.Double, pb.Boolean}
_CACHE_LIMIT: Final = 100_000
"""Topics (and metric names per topic) remembered; cleared when exceeded."""


def _signed_32(raw: int) -> float:
    return float(raw - (1 << 32) if raw >= 1 << 31 else raw)


def _signed_64(raw: int) -> float:
    return float(raw - (1 << 64) if raw >= 1 << 63 else raw)


_CONVERT: Final[dict[tuple[str | None, int], Callable[[Any], float]]] = {
    **{("int_value", t): _signed_32 for t in _SIGNED_32},
    **{("int_value", t): float for t in _UNSIGNED_32},
    ("long_value", pb.Int64): _signed_64,
    ("long_value", pb.UInt64): float,
    ("float_value", pb.Float): float,
    ("double_value", pb.Double): float,
    ("boolean_value", pb.Boolean): float,  # float(True) is 1.0
}
"""(the metric's value field, its datatype) -> the value as a float (signed integers travel
as two's complement in the proto's unsigned fields); a pair not here is not a number."""


class _Declared(NamedTuple):
    """A metric as a birth certificate declared it."""

    name: str
    datatype: int
    skip: bool  # bookkeeping, or not among the route's fields: not a reading
    field: str | None  # the value field its datatype travels in (None: not a number)
    convert: Callable[[Any], float] | None  # that field's value as a float


_FIELDS: Final = {datatype: field for field, datatype in _CONVERT}
"""The value field each numeric datatype travels in."""


class _Place(NamedTuple):
    """What one topic says, worked out once per topic."""

    kind: str
    group: str
    node: str
    device: str | None
    base: dict[str, str]  # the templates' values
    labels: dict[str, Label]  # by metric name
    state: _Node  # the node's (shared by all its topics)


_Tables = tuple[dict[int, _Declared], dict[str, int]]
"""A birth's metrics: by alias, and each name's datatype."""


@dataclass(slots=True)
class _Node:
    """What a host application knows of one edge node."""

    born: bool = False
    bd_seq: int | None = None
    seq: int | None = None
    tables: _Tables = field(default_factory=lambda: ({}, {}))
    devices: dict[str, _Tables] = field(default_factory=dict)
    rebirth_at_ms: int | None = None


@dataclass
class SparkplugStats:
    """Counters of the Sparkplug state machine.

    Attributes:
        births: NBIRTH and DBIRTH messages taken.
        deaths: NDEATH and DDEATH messages taken (stale NDEATHs not counted).
        stale_deaths: NDEATHs whose bdSeq was not the current birth's (ignored).
        seq_gaps: node messages whose seq was not the expected one.
        rebirths: rebirth requests sent.
        nulls: null metrics left out.
    """

    births: int = 0
    deaths: int = 0
    stale_deaths: int = 0
    seq_gaps: int = 0
    rebirths: int = 0
    nulls: int = 0


class SparkplugDecoder(Decoder):
    """Decodes a Sparkplug B namespace's messages, keeping per-node birth state.

    Args:
        route: a ``format = "sparkplug"`` route (its topic is the namespace).
        max_future_ms: refuse rows this far ahead of the arrival time (None: no check).
        rebirth: send rebirth requests on data before birth and on seq gaps.
    """

    def __init__(
        self,
        route: Route,
        *,
        max_future_ms: int | None = DEFAULT_LIMITS.max_future_ms,
        rebirth: bool = True,
    ) -> None:
        super().__init__(route, max_future_ms=max_future_ms)
        self.rebirth = rebirth
        self.sparkplug = SparkplugStats()
        self._nodes: dict[tuple[str, str], _Node] = {}
        self._places: dict[str, _Place] = {}
        self._declarations: dict[tuple[str, int], _Declared] = {}
        self._namespace_levels = len(route.topic.text.split("/"))
        self._wanted = frozenset(route.fields)
        self._arrival = route.timestamp.source == "arrival"
        self._commands: list[tuple[str, bytes]] = []
        self._refusals: list[InputError] = []

    def take_commands(self) -> list[tuple[str, bytes]]:
        """Rebirth requests to publish (QoS 0, as the specification says for commands)."""
        commands, self._commands = self._commands, []
        return commands

    def take_refusals(self) -> list[InputError]:
        """Metrics refused within a message whose other metrics were kept."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def node_state(self, group: str, node: str) -> tuple[bool, int | None]:
        """(born, last seq) of a node, for tests and diagnostics."""
        state = self._nodes.get((group, node))
        return (False, None) if state is None else (state.born, state.seq)

    # -- one message ---------------------------------------------------------------------------

    def decode(self, topic: str, levels: dict[str, str], payload: bytes, now_ms: int) -> list[Row]:
        """The rows of one Sparkplug message (births and data); deaths and commands give none.

        Raises:
            DecodeError: not a Sparkplug B topic or payload, data before birth, an unknown
                alias.
        """
        place = self._places.get(topic)
        if place is None:
            place = self._place(topic, levels)
        kind = place.kind
        if kind in {"NCMD", "DCMD"}:
            return []  # commands to nodes (ours among them), not readings
        try:
            message = pb.Payload.FromString(payload)
        except (ProtobufDecodeError, RuntimeWarning, ValueError) as exc:
            raise DecodeError(
                f"{self.where(topic)}: not a Sparkplug B payload (protobuf: {exc})",
                reason="not_sparkplug",
                expected="a protobuf-encoded org.eclipse.tahu.protobuf.Payload",
                found=f"{len(payload)} bytes starting {payload[:16]!r}",
            ) from None
        group, node, device, state = place.group, place.node, place.device, place.state
        if kind == "NDEATH":
            self._node_death(state, message)
            return []
        if kind == "NBIRTH":
            return self._node_birth(topic, place, state, message, now_ms)
        if not state.born:
            self._ask_rebirth(state, group, node, now_ms)
            raise DecodeError(
                f"{self.where(topic)}: {kind} from node {group}/{node} before its NBIRTH "
                "(a rebirth was requested)",
                reason="data_before_birth",
                expected="an NBIRTH of the node first",
                found=f"{kind} with seq {message.seq}",
            )
        seq = message.seq
        if seq or message.HasField("seq"):  # a message without one is not counted
            last = state.seq
            if last is not None and seq != (last + 1) % 256:
                self.sparkplug.seq_gaps += 1
                self._ask_rebirth(state, group, node, now_ms)
            state.seq = seq
        if kind == "DDATA":
            tables = state.devices.get(device) if device is not None else None
            if tables is None:
                self._ask_rebirth(state, group, node, now_ms)
                raise DecodeError(
                    f"{self.where(topic)}: DDATA from device {device!r} of node {group}/{node} "
                    "before its DBIRTH (a rebirth was requested)",
                    reason="data_before_birth",
                    expected="a DBIRTH of the device first",
                    found=f"DDATA with seq {message.seq}",
                )
            return self._rows(topic, place, message, tables, now_ms)
        if kind == "NDATA":
            return self._rows(topic, place, message, state.tables, now_ms)
        if kind == "DDEATH":
            state.devices.pop(device or "", None)
            self.sparkplug.deaths += 1
            return []
        # DBIRTH (a device message's topic names its device: ``_place``)
        tables = state.devices[device or ""] = self._birth_tables(topic, message)
        self.sparkplug.births += 1
        return self._rows(topic, place, message, tables, now_ms)

    def _place(self, topic: str, levels: dict[str, str]) -> _Place:
        """What ``topic`` says (remembered).

        Raises:
            DecodeError: it is not ``<namespace>/<group>/<type>/<node>[/<device>]``.
        """
        parts = topic.split("/")[self._namespace_levels :]
        if (
            len(parts) not in (3, 4)
            or parts[1] not in _TYPES
            or (len(parts) == 4) != parts[1].startswith("D")  # device messages name the device
            or not all(parts)
        ):
            raise DecodeError(
                f"{self.where(topic)}: not a Sparkplug B topic",
                reason="bad_topic",
                expected=f"{self.route.topic.text}/<group>/<NBIRTH|NDATA|...>/<node>, or "
                f"{self.route.topic.text}/<group>/<DBIRTH|DDATA|...>/<node>/<device>",
                found=repr(topic),
            )
        group, kind, node = parts[0], parts[1], parts[2]
        device = parts[3] if len(parts) == 4 else None
        base = {**levels, "group": group, "node": node, "device": device or NODE_DEVICE}
        state = self._nodes.get((group, node))
        if state is None:
            state = self._nodes[group, node] = _Node()
        place = _Place(kind, group, node, device, base, {}, state)
        if len(self._places) >= _CACHE_LIMIT:
            self._places.clear()
        self._places[topic] = place
        return place

    # -- the state machine -----------------------------------------------------------------------

    def _node_birth(
        self, topic: str, place: _Place, state: _Node, message: pb.Payload, now_ms: int
    ) -> list[Row]:
        tables = self._birth_tables(topic, message)
        state.born = True
        state.seq = message.seq if message.HasField("seq") else 0
        state.tables = tables
        state.devices = {}
        state.rebirth_at_ms = None
        state.bd_seq = _bd_seq(message)
        self.sparkplug.births += 1
        return self._rows(topic, place, message, tables, now_ms)

    def _node_death(self, state: _Node, message: pb.Payload) -> None:
        bd_seq = _bd_seq(message)
        if (
            state.born
            and bd_seq is not None
            and state.bd_seq is not None
            and bd_seq != state.bd_seq
        ):
            self.sparkplug.stale_deaths += 1  # the will of an older connection
            return
        state.born = False
        state.seq = None
        state.rebirth_at_ms = None  # data from a dead node earns a request at once
        state.tables = ({}, {})
        state.devices = {}
        self.sparkplug.deaths += 1

    def _ask_rebirth(self, state: _Node, group: str, node: str, now_ms: int) -> None:
        if not self.rebirth:
            return
        if state.rebirth_at_ms is not None and now_ms - state.rebirth_at_ms < REBIRTH_EVERY_MS:
            return
        state.rebirth_at_ms = now_ms
        command = pb.Payload(timestamp=now_ms)
        metric = command.metrics.add()
        metric.name = REBIRTH_METRIC
        metric.datatype = pb.Boolean
        metric.boolean_value = True
        self._commands.append(
            (f"{self.route.topic.text}/{group}/NCMD/{node}", command.SerializeToString())
        )
        self.sparkplug.rebirths += 1

    def _birth_tables(self, topic: str, message: pb.Payload) -> _Tables:
        aliases: dict[int, _Declared] = {}
        types: dict[str, int] = {}
        for index, metric in enumerate(message.metrics):
            self._check_name(topic, metric.name, index)
            if not metric.name:
                raise DecodeError(
                    f"{self.where(topic)}: birth metric {index} has no name",
                    reason="unnamed_birth_metric",
                    field=f"metrics[{index}]",
                    expected="every birth metric named (and typed)",
                    found=f"alias {metric.alias}" if metric.HasField("alias") else "no name",
                )
            types[metric.name] = metric.datatype
            if metric.HasField("alias"):
                aliases[metric.alias] = self._declared(metric.name, metric.datatype)
        return aliases, types

    def _declared(self, name: str, datatype: int) -> _Declared:
        """What a metric of this name and datatype is (remembered: nodes repeat theirs)."""
        key = (name, datatype)
        declared = self._declarations.get(key)
        if declared is None:
            field = _FIELDS.get(datatype)
            convert = None if field is None else _CONVERT[field, datatype]
            declared = _Declared(name, datatype, self._not_a_reading(name), field, convert)
            if len(self._declarations) >= _CACHE_LIMIT:
                self._declarations.clear()
            self._declarations[key] = declared
        return declared

    def _not_a_reading(self, name: str) -> bool:
        """Whether metric ``name`` is bookkeeping or left out by the route: not a reading."""
        wanted = self._wanted
        return (
            name == "bdSeq" or name.startswith(_BOOKKEEPING) or bool(wanted and name not in wanted)
        )

    def _check_name(self, topic: str, name: object, index: int) -> None:
        """Refuse a metric name that is not UTF-8 (protobuf then hands over the raw bytes)."""
        if not isinstance(name, str):
            raise DecodeError(
                f"{self.where(topic)}: the name of metric {index} is not UTF-8 text",
                reason="bad_metric_name",
                field=f"metrics[{index}].name",
                expected="a UTF-8 metric name",
                found=f"bytes {name!r:.60}",
            )

    # -- metrics to rows -------------------------------------------------------------------------

    def _rows(
        self, topic: str, place: _Place, message: pb.Payload, tables: _Tables, now_ms: int
    ) -> list[Row]:
        """The message's readings, one row per numeric metric.

        The hot path (data by alias): per metric its name, alias, datatype, null flag, value
        field and timestamp are read; everything else about it was worked out from the birth.
        """
        aliases, types = tables
        rows: list[Row] = []
        arrival = self._arrival
        default_ts, high = self._times(message, now_ms)
        labels = place.labels
        declared_for = aliases.get
        for index, metric in enumerate(message.metrics):
            name = metric.name
            if name:  # by name (births, and nodes that do not use aliases)
                self._check_name(topic, name, index)
                declared = self._declared(name, metric.datatype or types.get(name, pb.Unknown))
            else:
                alias = metric.alias
                found = declared_for(alias)
                if found is None or (not alias and not metric.HasField("alias")):
                    raise self._unknown_alias(topic, index, alias, aliases)
                declared = found
                override = metric.datatype
                if override and override != declared.datatype:
                    declared = self._declared(declared.name, override)
            name, datatype, skip, field, convert = declared
            if skip:
                continue
            if metric.is_null:
                self.sparkplug.nulls += 1
                continue
            which = metric.WhichOneof("value")
            if which != field or convert is None or which is None:
                self._not_a_number(topic, name, datatype, which, index)
                continue
            value = convert(getattr(metric, which))
            if value - value != 0.0:  # inf or nan
                self._not_finite(topic, name, value)
                continue
            ts = now_ms if arrival else metric.timestamp or _zero_or(metric, default_ts)
            if not MIN_TS_MS <= ts <= high:
                self.check_ts(topic, ts, now_ms, f"{name}.timestamp", None)  # raises
            label = labels.get(name) or self._label(topic, place, name)
            rows.append((label[0], ts, value, label[1], label[2], label[3]))
        return rows

    def _times(self, message: pb.Payload, now_ms: int) -> tuple[int, int]:
        """The default timestamp of the message's metrics, and the latest one taken.

        The default is the message's timestamp, or the arrival time if it has none (or the
        route says ``source = "arrival"``).
        """
        if self._arrival:
            default_ts = now_ms
        else:
            default_ts = message.timestamp
            if not default_ts and not message.HasField("timestamp"):
                default_ts = now_ms
        high = MAX_TS_MS
        if self.max_future_ms is not None:
            high = min(high, now_ms + self.max_future_ms)
        return default_ts, high

    def _label(self, topic: str, place: _Place, name: str) -> Label:
        """Metric ``name``'s label on ``topic``, remembered in ``place``."""
        labels = place.labels
        label = self.label(topic, place.base, name)
        if len(labels) >= _CACHE_LIMIT:
            labels.clear()
        labels[name] = label
        return label

    def _unknown_alias(
        self, topic: str, index: int, alias: int, aliases: dict[int, _Declared]
    ) -> DecodeError:
        return DecodeError(
            f"{self.where(topic)}: metric {index} has alias {alias}, which the "
            "birth certificate did not declare",
            reason="unknown_alias",
            field=f"metrics[{index}]",
            expected=f"one of the birth's aliases {sorted(aliases)[:20]}",
            found=f"alias {alias}",
        )

    def _not_finite(self, topic: str, name: str, value: float) -> None:
        self._refusals.append(
            SchemaError(
                f"{self.where(topic)}: metric {name!r} is not finite",
                reason="not_finite",
                field=name,
                expected="a finite number",
                found=repr(value),
            )
        )

    def _not_a_number(
        self, topic: str, name: str, datatype: int, kind: str | None, index: int
    ) -> None:
        """Record the refusal of a metric that is not a number (unless strings are skipped)."""
        if self.route.strings == "skip":
            return
        known = datatype in pb.DataType.values()
        type_name = pb.DataType.Name(datatype) if known else f"datatype {datatype}"
        if datatype in _STRINGS:
            reason = "string_metric"
            expected = "a number or a boolean (strings = 'skip' leaves text out)"
        elif kind is None or datatype not in _NUMERIC:
            reason, expected = "unsupported_datatype", "an integer, float, double or boolean"
        else:
            reason, expected = "datatype_mismatch", f"the value field of a {type_name}"
        self._refusals.append(
            DecodeError(
                f"{self.where(topic)}: metric {name!r} (metrics[{index}]) is a {type_name}, "
                "not a number",
                reason=reason,
                field=name,
                expected=expected,
                found=f"{type_name} in {kind or 'no value field'}",
            )
        )


def _zero_or(metric: pb.Payload.Metric, default_ts: int) -> int:
    """The timestamp of a metric whose timestamp reads 0: 0 if it says so, else the default."""
    return 0 if metric.HasField("timestamp") else default_ts


def _bd_seq(message: pb.Payload) -> int | None:
    for metric in message.metrics:
        if metric.name == "bdSeq":
            kind = metric.WhichOneof("value")
            if kind == "long_value":
                return int(metric.long_value)
            if kind == "int_value":
                return int(metric.int_value)
    return None
