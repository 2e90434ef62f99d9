"""Window result messages as polars frames: the result layout shared by the client and archive.

A window message (``results/<pipeline>``, JSON or MsgPack; see ``shoal.processors.results``)
becomes a ``WindowMessage``: its header and a frame with one row per key. Every frame this
package hands out has the *result layout*::

    pipeline  window  start  end  revision  partition  partitions  watermark  emitted_at
    key  rows  batches  <aggregates in the pipeline's order>

Count windows add ``index`` (the window's ordinal within its key), ``first_ts`` and
``last_ts`` (its first and last row's event time) after the aggregates; their ``start`` and
``end`` are the close step's event-time span, and a result row is identified by ``index``
instead of ``start`` (``ROW_SLOT``).

``key`` is a string, ``rows``, ``batches``, ``count`` and the count-window columns are Int64,
the header columns are Int64 (``pipeline`` and ``window`` strings), and every other
aggregate is Float64 (null where undefined, e.g. ``stddev`` of one value).
``(pipeline, window, start, partition, revision, part)`` identifies a message: a message
published twice after a combiner restart has the same identity and the same values;
``Deduplicator`` remembers recent identities. A window too large for one broker packet comes
as ``parts`` messages (``part`` 0.. ``parts - 1``), each with a subset of the keys; a message
without ``part``/``parts`` is the whole window (part 0 of 1). Every key is in exactly one part
of a revision, so a result *row* stays identified by ``ROW_IDENTITY`` and the frame layout has
no part columns; ``WindowMessage.part``/``parts`` tell a window's messages apart.

Pure (no MQTT); the client (``shoal.client``) and the archive both build on it, so it lives
below them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import orjson
import polars as pl

from shoal.errors import SchemaError

HEADER_SCHEMA: Final = pl.Schema(
    {
        "pipeline": pl.String(),
        "window": pl.String(),
        "start": pl.Int64(),
        "end": pl.Int64(),
        "revision": pl.Int64(),
        "partition": pl.Int64(),
        "partitions": pl.Int64(),
        "watermark": pl.Int64(),
        "emitted_at": pl.Int64(),
    }
)
"""The header columns every result frame starts with."""

IDENTITY: Final = ("pipeline", "window", "start", "partition", "revision")
"""Columns that identify one window message's rows (with ``WindowMessage.part``: the message)."""

ROW_IDENTITY: Final = (*IDENTITY, "key")
"""Columns that identify one result row."""

INTEGER_FIELDS: Final = frozenset(
    {"rows", "batches", "count", "end", "index", "first_ts", "last_ts", "superseded_by"}
)

DEFAULT_REMEMBER: Final = 100_000
"""Identities a ``Deduplicator`` remembers by default."""

Identity = tuple[str, str, int, int, int, int]
"""``(pipeline, window, start, partition, revision, part)`` of a window message."""

CopyKey = tuple[str, str, int, int, int, int, int]
"""``identity`` plus ``rows``: what tells one copy of a window message from another."""


RETRACTED: Final = "superseded_by"
"""The result field of a session window's *retraction*: the key's session moved to this
earlier start (a late piece reached it within ``allowed_lateness_ms``); the row has ``rows``
0 and marks that the key left this (window, start) (CONTRACT.md §14, "Corrections")."""

LATEST_OF: Final = ("pipeline", "window", "start", "partition", "key")
"""Columns of one result row across its revisions (``latest_revisions`` keeps one)."""


ROW_SLOT: Final = pl.coalesce("index", "start").alias("_slot")
"""Which window of its key a result row is: ``index`` for count windows (whose ``start`` is
the close step's span, which a re-publication after a restart may draw differently), else
``start``."""


def latest_revisions(frame: pl.DataFrame) -> pl.DataFrame:
    """Each result row's latest revision: the highest ``revision``, then the most ``rows``.

    A correction (revision above 1, pipelines with ``allowed_lateness_ms``) supersedes the
    lower revisions of its window; a revision never loses rows, so between two copies with
    the same revision (re-published after a combiner restart) the one with more rows is the
    later. Keeps the first row's order otherwise. A row whose latest revision is a
    retraction (``superseded_by``: its session moved to another start) is left out.
    """
    if frame.height == 0:
        return frame
    order = frame.with_row_index("_order")
    subset: list[str] = [c for c in LATEST_OF if c in frame.columns]
    if "index" in frame.columns:  # count windows: a row is (window, key, index), see ROW_SLOT
        order = order.with_columns(ROW_SLOT)
        subset = [("_slot" if c == "start" else c) for c in subset]
    latest = (
        order.sort("revision", "rows", "_order", descending=[True, True, False])
        .unique(subset=subset, keep="first")
        .sort("_order")
    )
    if RETRACTED in latest.columns:
        latest = latest.filter(pl.col(RETRACTED).is_null()).drop(RETRACTED)
    return latest.drop("_order", "_slot", strict=False)


def field_dtype(name: str) -> pl.DataType:
    """The dtype of a per-key result column in the result layout."""
    if name == "key":
        return pl.String()
    if name in INTEGER_FIELDS:
        return pl.Int64()
    return pl.Float64()


def empty_results(aggregates: tuple[str, ...] = ()) -> pl.DataFrame:
    """A result-layout frame with no rows (``aggregates`` in the pipeline's order)."""
    schema = dict(HEADER_SCHEMA)
    for name in ("key", "rows", "batches", *aggregates):
        schema[name] = field_dtype(name)
    return pl.DataFrame(schema=schema)


@dataclass(frozen=True, slots=True)
class WindowMessage:
    """One window result message of one combiner partition.

    Attributes:
        pipeline: the pipeline.
        window: the window's name (``tumbling-10s``).
        start: window start, epoch ms.
        end: window end (exclusive), epoch ms.
        revision: 1, higher if late data within allowed lateness updated the window.
        partition: the combiner partition that emitted it.
        partitions: how many partitions the pipeline has (each emits its own keys).
        watermark: the partition's close threshold when it emitted (None: unknown).
        emitted_at: the combiner's clock at emission, epoch ms.
        frame: one row per key, in the result layout.
        part: which part of a window split to fit the broker's packet limit (0-based).
        parts: how many parts this revision of the window has (1: not split).
    """

    pipeline: str
    window: str
    start: int
    end: int
    revision: int
    partition: int
    partitions: int
    watermark: int | None
    emitted_at: int
    frame: pl.DataFrame
    part: int = 0
    parts: int = 1

    @property
    def identity(self) -> Identity:
        """``(pipeline, window, start, partition, revision, part)``."""
        return (self.pipeline, self.window, self.start, self.partition, self.revision, self.part)

    @property
    def rows(self) -> int:
        """Measurements counted in this message (all its keys)."""
        return int(self.frame["rows"].sum()) if self.frame.height else 0

    @property
    def copy_key(self) -> CopyKey:
        """``identity`` plus ``rows``: a duplicate has the same.

        A window closed again after a combiner restart while late rows folded in may keep its
        revision but count more rows; it is then a later copy, not a duplicate (see
        ``rank``).
        """
        return (*self.identity, self.rows)

    @property
    def rank(self) -> tuple[int, int]:
        """How late this copy is: higher revision, then more rows, is later.

        The order ``latest_revisions`` keeps by; compare ranks of copies with the same
        ``(pipeline, window, start, partition)``.
        """
        return (self.revision, self.rows)


class Deduplicator:
    """Remembers the copy keys (``WindowMessage.copy_key``) of the last ``capacity`` messages.

    A combiner re-publishes a window after a crash within seconds to minutes, so a bounded
    memory of recent identities is enough; an archive reader deduplicates exactly instead.
    """

    def __init__(self, capacity: int = DEFAULT_REMEMBER) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self.duplicates = 0

    def first_time(self, key: Hashable) -> bool:
        """True the first time a key is offered, False (and counted) afterwards."""
        if key in self._seen:
            self.duplicates += 1
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True


def parse_window_message(payload: bytes, content_type: str | None = None) -> WindowMessage:
    """Parse a window result message, JSON or MsgPack (detected from the bytes if needed).

    Raises:
        SchemaError: the payload is not a shoal window result message.
    """
    is_json = (
        content_type.split(";", 1)[0].strip().lower().endswith("json")
        if content_type
        else payload[:1] in (b"{", b" ", b"\n", b"\r", b"\t")
    )
    try:
        body: Any = orjson.loads(payload) if is_json else msgpack.unpackb(payload, raw=False)
    except (orjson.JSONDecodeError, ValueError, msgpack.UnpackException) as exc:
        raise SchemaError(
            f"unreadable window result message: {exc}", reason="bad_result_message"
        ) from exc
    if not isinstance(body, dict):
        raise SchemaError(
            "window result message is not a map",
            reason="bad_result_message",
            found=type(body).__name__,
        )
    header = _header(body)
    split = _part(body)
    if "results" in body:
        columns = _rows_to_columns(body["results"])
    elif "columns" in body:
        columns = body["columns"]
        if not isinstance(columns, dict):
            raise SchemaError("'columns' is not a map", reason="bad_result_message")
    else:
        raise SchemaError(
            "window result message has neither 'results' nor 'columns'",
            reason="bad_result_message",
        )
    return WindowMessage(**header, frame=_frame(header, columns), part=split[0], parts=split[1])


def _part(body: dict[str, Any]) -> tuple[int, int]:
    """``(part, parts)``: absent on a whole window (part 0 of 1)."""
    part, parts = body.get("part", 0), body.get("parts", 1)
    if type(part) is not int or type(parts) is not int or not 0 <= part < parts:
        raise SchemaError(
            "bad window result part",
            reason="bad_result_message",
            field="part",
            expected="0 <= part < parts, integers",
            found=f"part={part!r:.20}, parts={parts!r:.20}",
        )
    return part, parts


def _header(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, dtype in HEADER_SCHEMA.items():
        value = body.get(name)
        if dtype == pl.String():
            ok = isinstance(value, str)
        elif name == "watermark":
            ok = value is None or type(value) is int
        else:
            ok = type(value) is int
        if not ok:
            raise SchemaError(
                "bad window result header",
                reason="bad_result_message",
                field=name,
                expected="a string" if dtype == pl.String() else "an integer",
                found=repr(value)[:40],
            )
        out[name] = value
    return out


def _rows_to_columns(rows: Any) -> dict[str, list[Any]]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SchemaError("'results' is not a list of maps", reason="bad_result_message")
    names: dict[str, None] = {}
    for row in rows[:1]:
        names.update(dict.fromkeys(row))
    return {name: [row.get(name) for row in rows] for name in names}


def _frame(header: dict[str, Any], columns: dict[str, Any]) -> pl.DataFrame:
    empty = not any(columns.values())
    for required in _LEADING:
        if required not in columns:
            if not empty:
                raise SchemaError(
                    "window result rows lack a column", reason="bad_result_message", field=required
                )
            columns = {**columns, required: []}
    try:
        fields = pl.DataFrame(
            [
                pl.Series(name, values, dtype=field_dtype(name), strict=False)
                for name, values in columns.items()
            ]
        )
    except (TypeError, ValueError, pl.exceptions.PolarsError) as exc:
        raise SchemaError(
            f"window result rows do not form a table: {exc}", reason="bad_result_message"
        ) from exc
    # A session window's rows carry their own end (CONTRACT.md §14): it replaces the header's.
    head = [
        pl.col(name) if name in _PER_ROW and name in fields.columns else pl.lit(value, dtype=dtype)
        for name, dtype in HEADER_SCHEMA.items()
        for value in [header[name]]
    ]
    rest = [c for c in fields.columns if c not in _LEADING and c not in _PER_ROW]
    return fields.select(
        *[h.alias(n) for h, n in zip(head, HEADER_SCHEMA, strict=True)], *_LEADING, *rest
    )


_LEADING: Final = ("key", "rows", "batches")
_PER_ROW: Final = frozenset({"end"})
