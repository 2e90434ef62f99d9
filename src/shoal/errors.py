"""The one exception tree of shoal; every error a user can see is one of these.

::

    ShoalError
    ├── InputError              bad input from the outside world (dead-lettered, never fatal)
    │   ├── DecodeError         the bytes are not a batch: framing, syntax, encoding, limits
    │   ├── SchemaError         a well-formed batch that breaks the contract: types, fields, rows
    │   └── FunctionError       a pipeline's user function failed on a batch (raised, garbage, time)
    ├── ConfigError             an invalid pipeline spec, profile, option or flag
    │   ├── TopicError          a name or root that cannot be part of a topic
    │   └── TraceError          a load trace that cannot run, or an unknown one
    ├── BrokerError             the broker: missing binary, unreachable, refused, too large
    │   ├── BrokerNotFoundError `mosquitto` is not on PATH
    │   └── PayloadTooLargeError a message would exceed the broker's size limit
    │       └── ResultTooLargeError one key's window result cannot fit any packet
    ├── ControlError            the control plane refused a request, or none answered
    ├── SpoolError              the gateway's on-disk spool cannot be read or written
    │   └── NotStoredError      sealed rows the spool refused (``shoal.gateway._sealer``)
    ├── StateCapError           a partial would grow a combiner's open state past its cap
    ├── SinkError               a sink's destination refused a write for good (needs an operator)
    └── UsageError              code called shoal with a value it cannot use (a bug in the caller)

Foreign exceptions are wrapped ``from exc`` at the seam that imports the foreign library.
Messages say what is wrong, where (topic, gateway, seq, field, row) and, where it helps, what
to do. ``InputError`` carries a stable machine-readable ``reason`` used as a counter label and
in dead-letter records.
"""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "BrokerNotFoundError",
    "ConfigError",
    "ControlError",
    "DecodeError",
    "FunctionError",
    "InputError",
    "PayloadTooLargeError",
    "ResultTooLargeError",
    "SchemaError",
    "ShoalError",
    "SinkError",
    "SpoolError",
    "StateCapError",
    "TopicError",
    "TraceError",
    "UsageError",
]


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""


class InputError(ShoalError):
    """Input from outside (a gateway's payload) that shoal refuses.

    Attributes:
        reason: stable, machine-readable family (``"not_finite"``, ``"bad_json"``, ...): the
            counter label, the dead letter's ``reason`` user property.
        code: stable, machine-readable and as specific as shoal can tell (``"json_syntax"``,
            ``"msgpack_extra_data"``, ``"invalid_utf8"``); the reason itself where no finer
            code applies. CONTRACT.md §8.1 lists every code with what to do about it.
        field: the field at fault, if any (``"value"``, ``"seq"``, ``"rows"``).
        row: the 0-based row at fault, if any.
        expected: what the contract wants there, in words.
        found: what was there instead, in words.
        offset: the 0-based byte offset in the payload where the problem was found, if known.
        line: with ``offset`` in JSON text, its 1-based line and column.
        column: see ``line``.
        format: the syntax the payload was read as (``"JSON"``, ``"MsgPack"``), once known.
        assumed: why it was read as that, in words (``"it starts with '{'"``).

    The message (``str(exc)``) is composed from these when asked for, so a decoder may add
    ``format`` and ``assumed`` after the error was raised deeper down.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        code: str | None = None,
        field: str | None = None,
        row: int | None = None,
        expected: str | None = None,
        found: str | None = None,
        offset: int | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        self.reason = reason
        self.code = code or reason
        self.field = field
        self.row = row
        self.expected = expected
        self.found = found
        self.offset = offset
        self.line = line
        self.column = column
        self.format: str | None = None
        self.assumed: str | None = None
        super().__init__(message)

    def __str__(self) -> str:
        where = []
        if self.field is not None:
            where.append(f"field {self.field!r}")
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.offset is not None:
            where.append(f"byte {self.offset}")
        if self.line is not None and self.column is not None:
            where.append(f"line {self.line}, column {self.column}")
        text = str(self.args[0]) if self.args else ""
        if where:
            text = f"{text} ({', '.join(where)})"
        if self.expected is not None or self.found is not None:
            text = f"{text}: expected {self.expected or '?'}, found {self.found or '?'}"
        if self.format is not None and self.assumed is not None:
            text = f"{text} [read as {self.format} because {self.assumed}]"
        return text

    def as_record(self) -> dict[str, str | int]:
        """The error as a flat record, for dead-letter messages and logs."""
        record: dict[str, str | int] = {
            "error": type(self).__name__,
            "reason": self.reason,
            "code": self.code,
        }
        keys = ("field", "row", "expected", "found", "offset", "line", "column", "format")
        for key in (*keys, "assumed"):
            value = getattr(self, key)
            if value is not None:
                record[key] = value
        record["message"] = str(self)
        return record


class DecodeError(InputError):
    """The bytes cannot be read as a batch (syntax, unknown encoding, limits, compression)."""


class SchemaError(InputError):
    """A readable batch that violates the wire contract (types, missing fields, bad rows)."""


class FunctionError(InputError):
    """A user function (``shoal.rules.functions``) failed on a batch: the batch is dead-lettered.

    ``reason``: ``function_error`` (it raised), ``function_bad_result`` (wrong length or
    type), ``function_timeout`` (past its per-batch budget), ``function_stuck`` (an earlier
    call has not returned yet) or ``function_degraded`` (not run: the pipeline's recent
    batches all ran past the budget; a probe runs now and then).
    """


class ConfigError(ShoalError):
    """An invalid configuration: pipeline spec, broker profile, CLI option.

    Attributes:
        field: the path of the setting at fault, where the validator knows it
            (``"windows[0].size_ms"``, ``"limits.max_rows"``; None: the configuration as a
            whole, or not known).
        reason: a stable, machine-readable code where one is more specific than "invalid"
            (``"unknown_aggregate"``), else None.
    """

    def __init__(
        self, message: str, *, field: str | None = None, reason: str | None = None
    ) -> None:
        self.field = field
        self.reason = reason
        super().__init__(message)


class TopicError(ConfigError):
    """A stream, pipeline or gateway name, or a topic root, that cannot be part of a topic."""


class TraceError(ConfigError):
    """A load trace that cannot run (phases out of order, no gateways), or an unknown name."""


class BrokerError(ShoalError):
    """The MQTT broker could not be started, reached, or used as asked."""


class BrokerNotFoundError(BrokerError):
    """The ``mosquitto`` binary is not installed or not on PATH."""


class PayloadTooLargeError(BrokerError):
    """A message is larger than the broker accepts; it was not sent."""


class ResultTooLargeError(PayloadTooLargeError):
    """One key's window result row is larger than any packet the broker accepts.

    The combiner splits a large window into parts, but a part holds at least one key; a row
    that cannot fit alone is dead-lettered (``reason`` ``result_too_large``), counted and
    left out of the window's messages, never retried.

    Attributes:
        window: the window's name.
        start: the window's start, epoch ms.
        key: the key whose row does not fit.
        size: the row's encoded size, bytes.
        limit: the bytes a window message may take.
    """

    reason = "result_too_large"

    def __init__(self, *, window: str, start: int, key: str | None, size: int, limit: int) -> None:
        self.window = window
        self.start = start
        self.key = key
        self.size = size
        self.limit = limit
        super().__init__(
            f"the result of key {key!r} in window {window}/{start} is {size} bytes encoded, "
            f"more than the {limit} bytes a window message may take under the broker's "
            "max_packet_size; it was dead-lettered, not published. Raise max_packet_size or "
            "use smaller aggregates (e.g. fewer quantiles)."
        )

    def as_record(self) -> dict[str, str | int]:
        """The error as a flat record, for dead-letter messages and logs."""
        return {
            "error": type(self).__name__,
            "reason": self.reason,
            "code": self.reason,
            "field": "results",
            "found": f"{self.size} bytes",
            "expected": f"at most {self.limit} bytes",
            "message": str(self),
        }


class StateCapError(ShoalError):
    """Applying a partial would grow a combiner's open window state beyond its cap.

    The cap (``[limits] max_state_cells``) counts state cells: merged (window, key) rows and
    quantile-sketch buckets. The partial is refused whole: dead-lettered (``reason``
    ``state_cap_exceeded``, its rows in the record), counted (``partials_over_cap``) and its
    seq treated as handled, so the watermark moves on (docs/guarantees.md "Bounded memory").

    Attributes:
        gateway_id: the batch's gateway.
        seq: the batch's seq.
        cells: state cells held when the partial arrived (merged).
        incoming: cells the partial could add at most (its rows and sketch buckets).
        cap: the partition's cap: ``max_state_cells``, or its default sized from the memory
            the combiner may use.
    """

    reason = "state_cap_exceeded"

    def __init__(self, *, gateway_id: str, seq: int, cells: int, incoming: int, cap: int) -> None:
        self.gateway_id = gateway_id
        self.seq = seq
        self.cells = cells
        self.incoming = incoming
        self.cap = cap
        super().__init__(
            f"partial of batch {gateway_id}/{seq} refused: the combiner holds {cells} state "
            f"cells and the partial could add {incoming}, beyond max_state_cells = {cap}; it "
            "was dead-lettered, not applied. Raise [limits] max_state_cells, add partitions, "
            "or use fewer keys or shorter windows."
        )

    def as_record(self) -> dict[str, str | int]:
        """The error as a flat record, for dead-letter messages and logs."""
        return {
            "error": type(self).__name__,
            "reason": self.reason,
            "code": self.reason,
            "field": "state",
            "found": f"{self.cells} + {self.incoming} cells",
            "expected": f"at most {self.cap} cells",
            "message": str(self),
        }


class ControlError(ShoalError):
    """A pipeline request the control plane refused, the broker denied, or nobody answered.

    Attributes:
        reason: stable, machine-readable code (``"name_clash"``, ``"not_authorized"``,
            ``"timeout"``, ...), also the CLI's ``--json`` ``reason``.
        field: the path of the spec field at fault (``"windows[0].size_ms"``), if any.
    """

    def __init__(self, message: str, *, reason: str, field: str | None = None) -> None:
        self.reason = reason
        self.field = field
        super().__init__(message)


class SpoolError(ShoalError):
    """The gateway spool on disk cannot be opened, read or written."""


class SinkError(ShoalError):
    """A sink's destination refused a write in a way retrying cannot fix.

    For example a PostgreSQL table whose column has another type than the results need, or
    a web hook URL that is not http(s). Transient failures (a database restarting, a web
    hook answering 503) are retried by the sink and never raise this. Nothing the sink could
    not write has been acknowledged to the broker, so it comes again once fixed.
    """


class UsageError(ShoalError):
    """Shoal was called with a value it cannot use: a bug in the calling code, not bad input.

    For example a fake clock moved backwards, or a component looked up by a name that does
    not exist.
    """
