"""Sparkplug B (v3.0) device messages to rows: births, aliases, deaths, seq gaps, rebirth.

Topics are ``<namespace>/<group>/<type>/<node>[/<device>]`` (the route's ``topic`` is the
namespace, ``spBv1.0``). Payloads are decoded with the official ``sparkplug_b.proto``
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from google.protobuf.message import DecodeError as ProtobufDecodeError

from shoal.adapters._proto import sparkplug_b_pb2 as pb
from shoal.adapters.decode import Decoder, Row
from shoal.adapters.mapping import Route
from shoal.errors import DecodeError, InputError, SchemaError
from shoal.schemas import DEFAULT_LIMITS

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


@dataclass
class _Node:
    """What a host application knows of one edge node."""

    born: bool = False
    bd_seq: int | None = None
    seq: int | None = None
    aliases: dict[int, tuple[str, int]] = field(default_factory=dict)  # alias -> (name, type)
    types: dict[str, int] = field(default_factory=dict)  # name -> datatype
    devices: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)
    device_types: dict[str, dict[str, int]] = field(default_factory=dict)
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
        self._namespace_levels = len(route.topic.text.split("/"))
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
        parts = topic.split("/")[self._namespace_levels :]
        if len(parts) not in (3, 4) or parts[1] not in _TYPES:
            raise DecodeError(
                f"{self.where(topic)}: not a Sparkplug B topic",
                reason="bad_topic",
                expected=f"{self.route.topic.text}/<group>/<NBIRTH|NDATA|...>/<node>[/<device>]",
                found=repr(topic),
            )
        group, kind, node = parts[0], parts[1], parts[2]
        device = parts[3] if len(parts) == 4 else None
        if kind in ("NCMD", "DCMD"):
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
        state = self._nodes.setdefault((group, node), _Node())
        base = {**levels, "group": group, "node": node, "device": device or NODE_DEVICE}
        if kind == "NDEATH":
            self._node_death(state, message)
            return []
        if kind == "NBIRTH":
            return self._node_birth(topic, state, message, base, now_ms)
        if not state.born:
            self._ask_rebirth(state, group, node, now_ms)
            raise DecodeError(
                f"{self.where(topic)}: {kind} from node {group}/{node} before its NBIRTH "
                "(a rebirth was requested)",
                reason="data_before_birth",
                expected="an NBIRTH of the node first",
                found=f"{kind} with seq {message.seq}",
            )
        self._check_seq(state, message, (group, node), now_ms)
        if kind == "DDEATH":
            state.devices.pop(device or "", None)
            state.device_types.pop(device or "", None)
            self.sparkplug.deaths += 1
            return []
        if kind == "DBIRTH":
            assert device is not None
            aliases, types = self._birth_tables(topic, message)
            state.devices[device] = aliases
            state.device_types[device] = types
            self.sparkplug.births += 1
            return self._rows(topic, message, (aliases, types), base, now_ms)
        if kind == "DDATA":
            if device not in state.devices:
                self._ask_rebirth(state, group, node, now_ms)
                raise DecodeError(
                    f"{self.where(topic)}: DDATA from device {device!r} of node {group}/{node} "
                    "before its DBIRTH (a rebirth was requested)",
                    reason="data_before_birth",
                    expected="a DBIRTH of the device first",
                    found=f"DDATA with seq {message.seq}",
                )
            tables = (state.devices[device], state.device_types[device])
            return self._rows(topic, message, tables, base, now_ms)
        return self._rows(topic, message, (state.aliases, state.types), base, now_ms)  # NDATA

    # -- the state machine -----------------------------------------------------------------------

    def _node_birth(
        self, topic: str, state: _Node, message: pb.Payload, base: dict[str, str], now_ms: int
    ) -> list[Row]:
        aliases, types = self._birth_tables(topic, message)
        state.born = True
        state.seq = message.seq if message.HasField("seq") else 0
        state.aliases, state.types = aliases, types
        state.devices, state.device_types = {}, {}
        state.rebirth_at_ms = None
        state.bd_seq = _bd_seq(message)
        self.sparkplug.births += 1
        return self._rows(topic, message, (aliases, types), base, now_ms)

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
        state.aliases, state.types = {}, {}
        state.devices, state.device_types = {}, {}
        self.sparkplug.deaths += 1

    def _check_seq(
        self, state: _Node, message: pb.Payload, node: tuple[str, str], now_ms: int
    ) -> None:
        if not message.HasField("seq"):
            return
        expected = None if state.seq is None else (state.seq + 1) % 256
        if expected is not None and message.seq != expected:
            self.sparkplug.seq_gaps += 1
            self._ask_rebirth(state, *node, now_ms)
        state.seq = message.seq

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

    def _birth_tables(
        self, topic: str, message: pb.Payload
    ) -> tuple[dict[int, tuple[str, int]], dict[str, int]]:
        aliases: dict[int, tuple[str, int]] = {}
        types: dict[str, int] = {}
        for index, metric in enumerate(message.metrics):
            self._check_name(topic, metric, index)
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
                aliases[metric.alias] = (metric.name, metric.datatype)
        return aliases, types

    def _check_name(self, topic: str, metric: pb.Payload.Metric, index: int) -> None:
        """Refuse a metric name that is not UTF-8 (protobuf then hands over the raw bytes)."""
        name: object = metric.name
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
        self,
        topic: str,
        message: pb.Payload,
        tables: tuple[dict[int, tuple[str, int]], dict[str, int]],
        base: dict[str, str],
        now_ms: int,
    ) -> list[Row]:
        aliases, types = tables
        rows: list[Row] = []
        wanted = set(self.route.fields)
        arrival = self.route.timestamp.source == "arrival"
        default_ts = message.timestamp if message.HasField("timestamp") else now_ms
        for index, metric in enumerate(message.metrics):
            self._check_name(topic, metric, index)
            if metric.name:
                name = metric.name
                datatype = metric.datatype or types.get(name, pb.Unknown)
            elif metric.HasField("alias") and metric.alias in aliases:
                name, datatype = aliases[metric.alias]
                datatype = metric.datatype or datatype
            else:
                raise DecodeError(
                    f"{self.where(topic)}: metric {index} has alias {metric.alias}, which the "
                    "birth certificate did not declare",
                    reason="unknown_alias",
                    field=f"metrics[{index}]",
                    expected=f"one of the birth's aliases {sorted(aliases)[:20]}",
                    found=f"alias {metric.alias}",
                )
            if name == "bdSeq" or name.startswith(_BOOKKEEPING) or (wanted and name not in wanted):
                continue
            if metric.is_null:
                self.sparkplug.nulls += 1
                continue
            value = self._value(topic, metric, name, datatype, index)
            if value is None:
                continue
            if arrival:
                ts = now_ms
            else:
                ts = metric.timestamp if metric.HasField("timestamp") else default_ts
                ts = self.check_ts(topic, ts, now_ms, f"{name}.timestamp", None)
            sensor_id, label, kind, unit = self.label(topic, base, name)
            rows.append((sensor_id, ts, value, label, kind, unit))
        return rows

    def _value(
        self, topic: str, metric: pb.Payload.Metric, name: str, datatype: int, index: int
    ) -> float | None:
        """The metric's value as a float; None when it is left out (refusals recorded)."""
        kind = metric.WhichOneof("value")
        value = _number(metric, datatype, kind)
        if value is not None:
            if math.isfinite(value):
                return value
            self._refusals.append(
                SchemaError(
                    f"{self.where(topic)}: metric {name!r} is not finite",
                    reason="not_finite",
                    field=name,
                    expected="a finite number",
                    found=repr(value),
                )
            )
            return None
        if self.route.strings == "skip":
            return None
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
        return None


def _number(metric: pb.Payload.Metric, datatype: int, kind: str | None) -> float | None:
    """A numeric metric's value (signed integers are two's complement); None otherwise."""
    if kind == "int_value" and datatype in _SIGNED_32:
        raw = metric.int_value
        return float(raw - (1 << 32) if raw >= 1 << 31 else raw)
    if kind == "int_value" and datatype in _UNSIGNED_32:
        return float(metric.int_value)
    if kind == "long_value" and datatype == pb.Int64:
        raw = metric.long_value
        return float(raw - (1 << 64) if raw >= 1 << 63 else raw)
    if kind == "long_value" and datatype == pb.UInt64:
        return float(metric.long_value)
    if kind == "float_value" and datatype == pb.Float:
        return float(metric.float_value)
    if kind == "double_value" and datatype == pb.Double:
        return float(metric.double_value)
    if kind == "boolean_value" and datatype == pb.Boolean:
        return 1.0 if metric.boolean_value else 0.0
    return None


def _bd_seq(message: pb.Payload) -> int | None:
    for metric in message.metrics:
        if metric.name == "bdSeq":
            kind = metric.WhichOneof("value")
            if kind == "long_value":
                return int(metric.long_value)
            if kind == "int_value":
                return int(metric.int_value)
    return None
