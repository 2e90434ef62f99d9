"""What leaves a pipeline, as bytes: window results, per-key results, late rows, dead letters.

Window result message (``results/<pipeline>``), JSON::

    {"shoal": 1, "pipeline": "default", "window": "tumbling-10s", "start": 1700000000000,
     "end": 1700000010000, "revision": 1, "partition": 0, "partitions": 1,
     "watermark": 1700000012345, "emitted_at": 1700000012400, "keys": 2, "rows": 500,
     "results": [{"key": "gw00-s0001", "rows": 250, "batches": 3, "count": 250,
                  "mean": 21.4, ...}, ...]}

The MsgPack form carries the same header with ``"columns": {name: [values...]}`` instead of
``results`` (columnar, one list per field). ``(pipeline, window, start, partition, revision, part)``
identifies a message: after a combiner crash a window may be published again, with the same
identity and the same values, so consumers can deduplicate.

A window whose message would exceed the broker's packet limit is published as several
*parts* (``shoal.processors.result_parts``): each is a complete window message for a subset
of the keys with ``"part"`` (0-based) and ``"parts"`` (how many); ``keys`` and ``rows`` count
that part. A message without them is the whole window (part 0 of 1).

A *correction* (pipeline with ``allowed_lateness_ms``) is the same message for a window with
``revision`` above 1 and ``"correction": true``: late rows were folded into the window, and
it supersedes every lower revision of the same (pipeline, window, start, partition). A
session window's correction may hold *retractions*: a key whose session moved to an earlier
start (a late piece extended it backwards or joined it to an earlier session) comes with
``rows`` 0 and ``superseded_by``, its new start; the new session is in that start's message.

Per-key message (``results/<pipeline>/<key>``, retained JSON): one result row plus
``pipeline``, ``window``, ``start``, ``end``, ``revision`` and ``emitted_at`` (and
``correction`` on corrections).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import msgpack
import numpy as np
import orjson
import polars as pl

from shoal.processors.combine import LateRows
from shoal.schemas import SCHEMA_VERSION
from shoal.schemas.results import RETRACTED

JSON_CONTENT_TYPE: Final = "application/json"
MSGPACK_CONTENT_TYPE: Final = "application/msgpack"
FIRST_REVISION: Final = 1


@dataclass(frozen=True, slots=True)
class WindowResult:
    """The results of one (window, start) closed by one partition."""

    window: str
    start: int
    end: int
    frame: pl.DataFrame  # key, rows, batches, aggregates...
    revision: int = FIRST_REVISION
    part: int = 0
    """Which part of a window split to fit the broker's packet limit (``result_parts``)."""
    parts: int = 1
    """How many parts the window was split into (1: not split)."""

    @property
    def rows(self) -> int:
        """Measurements counted in this window (all keys)."""
        return int(self.frame["rows"].sum())

    @property
    def correction(self) -> bool:
        """Whether late rows were folded in (the revision is above the first)."""
        return self.revision > FIRST_REVISION


def split_windows(
    closed: pl.DataFrame,
    revisions: Mapping[tuple[str, int], int] | None = None,
    sessions: Collection[str] = (),
) -> list[WindowResult]:
    """Group a ``ClosedWindows.frame`` by (window, start), in close order.

    ``revisions``: ``ClosedWindows.revisions`` (windows not in it are revision 1).
    ``sessions``: ``ClosedWindows.sessions``: the results of these windows (sessions of
    several keys sharing a start) keep each key's ``end``; the message's ``end`` is the
    largest.
    """
    revisions = revisions or {}
    if closed.height and closed["start"].n_unique() == 1 and closed["window"].n_unique() == 1:
        # The common case (one window closes at a time): no grouping.
        groups = [((closed["window"][0], closed["start"][0]), closed)]
    elif RETRACTED not in closed.columns and (runs := window_runs(closed)) is not None:
        return _split_runs(closed, runs, revisions, sessions)
    else:
        groups = list(closed.group_by("window", "start", maintain_order=True))
    out = []
    for (window, start), group in groups:
        name, begin = str(window), int(start)
        part = group
        revision = revisions.get((name, begin), FIRST_REVISION)
        if RETRACTED in part.columns and part[RETRACTED].null_count() == part.height:
            part = part.drop(RETRACTED)  # present only in messages holding a retraction
        if name in sessions:
            end = int(part["end"].max())  # type: ignore[arg-type]
            frame = session_layout(part.drop("window", "start"))
        else:
            end, frame = int(part["end"][0]), part.drop("window", "start", "end")
        out.append(WindowResult(name, begin, end, frame, revision))
    out.sort(key=lambda r: (r.end, r.window))
    return out


def window_runs(closed: pl.DataFrame) -> list[tuple[str, int, int, int]] | None:
    """(window, start, first row, row after the last) of each message's rows, in order.

    None unless the rows of every (window, start) are one run (as a close orders them:
    session windows close sorted by start, a step of aligned windows is one start).
    """
    if closed.height == 0:
        return []
    changes = closed.select(
        (pl.col("window").ne_missing(pl.col("window").shift()))
        | (pl.col("start").ne_missing(pl.col("start").shift()))
    ).to_series()
    firsts = np.flatnonzero(changes.to_numpy())
    names = closed["window"].gather(firsts).to_list()
    starts = closed["start"].gather(firsts).to_list()
    if len(set(zip(names, starts, strict=True))) < len(firsts):
        return None
    ends = [*firsts[1:].tolist(), closed.height]
    return [
        (str(n), int(b), int(a), e)
        for n, b, a, e in zip(names, starts, firsts.tolist(), ends, strict=True)
    ]


def _split_runs(
    closed: pl.DataFrame,
    runs: list[tuple[str, int, int, int]],
    revisions: Mapping[tuple[str, int], int],
    sessions: Collection[str],
) -> list[WindowResult]:
    """``split_windows`` of a frame whose messages are runs (``window_runs``): by slices.

    Many messages in one close (session windows at many keys, each start a message) cost a
    grouping and a frame per message; the runs cut two laid-out frames instead.
    """
    as_session = session_layout(closed).drop("window", "start")
    as_aligned = closed.drop("window", "start", "end")
    ends = closed["end"].to_numpy()
    out = []
    for name, begin, a, b in runs:
        revision = revisions.get((name, begin), FIRST_REVISION)
        if name in sessions:
            frame, end = as_session.slice(a, b - a), int(ends[a:b].max())
        else:
            frame, end = as_aligned.slice(a, b - a), int(ends[a])
        out.append(WindowResult(name, begin, end, frame, revision))
    out.sort(key=lambda r: (r.end, r.window))
    return out


def session_layout(closed: pl.DataFrame) -> pl.DataFrame:
    """A closed frame's columns in a session message's order: key and end first."""
    return closed.select(
        *[c for c in ("window", "start") if c in closed.columns],
        "key",
        "end",
        pl.exclude("window", "start", "key", "end"),
    )


def _session_rows(closed: pl.DataFrame, sessions: Collection[str]) -> pl.DataFrame | None:
    """The rows of ``closed``'s session windows (None: none, or retractions among them)."""
    if not sessions or RETRACTED in closed.columns:
        return None
    rows = closed.filter(pl.col("window").is_in(list(sessions)))
    return rows if rows.height else None


def session_keys(closed: pl.DataFrame, sessions: Collection[str]) -> WindowResult | None:
    """The per-key rows of every session message of a close, as one result to publish.

    Its frame has each row's ``window`` and ``start`` (``key_payloads`` reads them), rows
    in the order of their starts, so a key closing two sessions at once keeps its later
    one retained. None when the close has no session rows, or has retractions or
    corrections (those are published message by message).
    """
    rows = _session_rows(closed, sessions)
    if rows is None:
        return None
    frame = session_layout(rows)
    return WindowResult(
        str(rows["window"][0]),
        int(rows["start"].min()),  # type: ignore[arg-type]
        int(rows["end"].max()),  # type: ignore[arg-type]
        frame,
    )


def session_lines(closed: pl.DataFrame, sessions: Collection[str]) -> dict[tuple[str, int], bytes]:
    """Each session message's rows as ``ndjson_rows`` encodes them, all encoded at once.

    (window, start) -> its lines, for the session windows of ``closed``; empty unless the
    messages are runs (``window_runs``) without retractions. At 100,000 keys with every
    row its own session, a close holds hundreds of messages, and encoding each apart cost
    more than the close.
    """
    rows = _session_rows(closed, sessions)
    if rows is None:
        return {}
    runs = window_runs(rows)
    if runs is None or len(runs) < 2:
        return {}
    ndjson = session_layout(rows).drop("window", "start").write_ndjson().encode()
    newlines = np.flatnonzero(np.frombuffer(ndjson, dtype=np.uint8) == ord("\n"))
    bounds = [0, *(newlines + 1).tolist()]
    return {(name, begin): ndjson[bounds[a] : bounds[b]] for name, begin, a, b in runs}


@dataclass(frozen=True, slots=True)
class Emission:
    """Who emits, and when: the common header of result messages."""

    pipeline: str
    partition: int
    partitions: int
    watermark: int | None
    emitted_at_ms: int
    version: int | None = None
    """The spec version that computed the results (None: a pipeline from a file)."""


def _header(result: WindowResult, ctx: Emission) -> dict[str, Any]:
    header: dict[str, Any] = {
        "shoal": SCHEMA_VERSION,
        "pipeline": ctx.pipeline,
        "window": result.window,
        "start": result.start,
        "end": result.end,
        "revision": result.revision,
        "partition": ctx.partition,
        "partitions": ctx.partitions,
        "watermark": ctx.watermark,
        "emitted_at": ctx.emitted_at_ms,
        "keys": result.frame.height,
        "rows": result.rows,
    }
    if ctx.version is not None:  # a pipeline deployed at run time: which version computed it
        header["version"] = ctx.version
    if result.correction:
        header["correction"] = True
    if result.parts > 1:  # absent on a whole window, so old consumers read it as before
        header["part"] = result.part
        header["parts"] = result.parts
    return header


def ndjson_rows(result: WindowResult) -> bytes:
    """The window's rows as NDJSON, one line per row: encoded once for both messages.

    ``json_rows`` joins the lines into the window message's array and ``key_messages`` gives
    each key its line: a sliding window's step publishes both for every key.
    """
    return result.frame.write_ndjson().encode()


def json_rows(result: WindowResult, lines: bytes | None = None) -> bytes:
    """The ``results`` array of a window's JSON message (the bulk of it).

    ``lines``: ``ndjson_rows(result)`` if already encoded; the array is then those lines
    joined (the same bytes as polars' JSON array: each row is one line).
    """
    if lines is not None:
        return b"[" + lines.rstrip(b"\n").replace(b"\n", b",") + b"]"
    return result.frame.write_json().encode() if result.frame.height else b"[]"


def window_json(result: WindowResult, ctx: Emission, rows: bytes | None = None) -> bytes:
    """The window's JSON message (all keys of this partition).

    ``rows``: ``json_rows(result)`` if already encoded (ahead of the close).
    """
    head = orjson.dumps(_header(result, ctx))
    body = json_rows(result) if rows is None else rows
    return b"".join((head[:-1], b',"results":', body, b"}"))  # one copy of the (large) rows


def window_msgpack(result: WindowResult, ctx: Emission) -> bytes:
    """The window's MsgPack message (columnar)."""
    header = _header(result, ctx)
    header["columns"] = {name: result.frame[name].to_list() for name in result.frame.columns}
    packed = msgpack.packb(header, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def key_messages(
    result: WindowResult,
    pipeline: str,
    emitted_at_ms: int,
    lines: Sequence[bytes] | None = None,
) -> list[tuple[str | None, bytes]]:
    """(key, retained JSON) per key of the window (a session's retraction has none).

    Each message is the window's fields (``pipeline`` to ``emitted_at``) followed by the key's
    result row (``key_payloads``, joined).
    """
    head, rests = key_payloads(result, pipeline, emitted_at_ms, lines)
    return [(key, head + rest) for key, rest in rests]


def key_rests(ndjson: bytes) -> list[bytes]:
    """Each NDJSON line (``ndjson_rows``) without its opening brace and its newline.

    What ``key_payloads`` gives each key after the shared head, one slice per line from the
    newlines' positions (found in one pass): a third less CPU than splitting the lines and
    slicing each again, the same bytes.
    """
    ends = np.flatnonzero(np.frombuffer(ndjson, dtype=np.uint8) == ord("\n"))
    if len(ends) == 0:
        return []
    starts = np.empty_like(ends)
    starts[0], starts[1:] = 1, ends[:-1] + 2  # past the newline and the brace
    return [ndjson[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def key_columns(
    result: WindowResult, pipeline: str, emitted_at_ms: int, ndjson: bytes
) -> tuple[bytes, list[str | None], list[bytes]]:
    """``key_payloads`` as columns: the shared head, the keys and the rest of each message.

    ``ndjson``: the frame's rows as ``ndjson_rows`` encoded them. For windows whose rows
    all have the window's end and no retraction (not sessions): a tuple per key is a
    container the garbage collector walks, and 100,000 of them a step cost more than the
    rest of building the messages.

    Raises:
        ValueError: a session's frame (a per-row ``end``, or retractions).
    """
    if "end" in result.frame.columns or RETRACTED in result.frame.columns:
        raise ValueError("key_columns: a session's rows have their own ends")
    if result.frame.height == 0:
        return b"", [], []
    return (
        _fields(result, pipeline, emitted_at_ms),
        result.frame["key"].to_list(),
        key_rests(ndjson),
    )


def key_payloads(
    result: WindowResult,
    pipeline: str,
    emitted_at_ms: int,
    lines: Sequence[bytes] | None = None,
) -> tuple[bytes, list[tuple[str | None, bytes]]]:
    """``key_messages`` as the beginning all of them share and (key, the rest) per key.

    Each key's message is ``head + rest``: the window's fields without the closing brace, then
    the key's result row without its opening one (``Session.publish_many`` takes them so,
    without a concatenated payload per key). The rows are encoded once for the whole frame: a
    window of a sliding kind gives every key a message every step, and encoding them a slice
    at a time cost more than publishing them. ``lines``: the frame's rows already encoded
    (``ndjson_rows``, split into lines), for windows whose rows all have the window's end (not
    sessions). A session's messages (a per-row end) share no head: ``head`` is empty.
    ``key_columns`` gives the same without a tuple per key.
    """
    if RETRACTED in result.frame.columns:  # its key's session is in another message now
        lines = None  # lines of the rows before the filter
        result = replace(result, frame=result.frame.filter(pl.col(RETRACTED).is_null()))
        result = replace(result, frame=result.frame.drop(RETRACTED))
    if result.frame.height == 0:
        return b"", []
    keys = result.frame["key"].to_list()
    if "start" in result.frame.columns:  # several sessions' messages (``session_keys``)
        head = _head(result, pipeline, emitted_at_ms, pl.col("end"), each_row=True)
        framed = result.frame.select(*head, pl.exclude("window", "start", "end"))
        return b"", list(zip(keys, framed.write_ndjson().encode().splitlines(), strict=True))
    if "end" in result.frame.columns:  # a session's own end (``split_windows``): per row
        head = _head(result, pipeline, emitted_at_ms, pl.col("end"))
        framed = result.frame.select(*head, pl.exclude("end"))
        return b"", list(zip(keys, framed.write_ndjson().encode().splitlines(), strict=True))
    prefix = _fields(result, pipeline, emitted_at_ms)
    if lines is None:
        lines = ndjson_rows(result).splitlines()
    return prefix, [(key, line[1:]) for key, line in zip(keys, lines, strict=True)]


def _fields(result: WindowResult, pipeline: str, emitted_at_ms: int) -> bytes:
    """A per-key message's beginning: the window's fields, without the closing brace."""
    line = pl.select(*_head(result, pipeline, emitted_at_ms, pl.lit(result.end)))
    encoded = line.write_ndjson().encode().rstrip()
    return encoded[:-1] + b","


def _head(
    result: WindowResult,
    pipeline: str,
    emitted_at_ms: int,
    end: pl.Expr,
    *,
    each_row: bool = False,
) -> list[pl.Expr]:
    """The window's fields that begin every per-key message, in the contract's order.

    ``each_row``: the frame has each row's ``window`` and ``start`` (``session_keys``).
    """
    return [
        pl.lit(pipeline).alias("pipeline"),
        pl.col("window") if each_row else pl.lit(result.window).alias("window"),
        pl.col("start") if each_row else pl.lit(result.start).alias("start"),
        end.alias("end"),
        pl.lit(result.revision).alias("revision"),
        *([pl.lit(value=True).alias("correction")] if result.correction else []),
        pl.lit(emitted_at_ms).alias("emitted_at"),
    ]


def late_message(late: LateRows, pipeline: str, partition: int, at_ms: int) -> bytes:
    """The late side-topic record for one batch's late rows (JSON)."""
    head = orjson.dumps(
        {
            "shoal": SCHEMA_VERSION,
            "pipeline": pipeline,
            "partition": partition,
            "gateway_id": late.gateway_id,
            "seq": late.seq,
            "rows": late.rows,
            "at": at_ms,
        }
    )
    return head[:-1] + b',"late":' + late.frame.write_json().encode() + b"}"


def late_memberships(body: dict[str, Any], window: str | None) -> int:
    """Rows a late message (``late_message``) reports for the window spec ``window``.

    The message's own ``rows`` counts a row once per window it was late for (hopping
    windows, several window specs); per window spec, a tumbling window counts measurements.
    ``window=None``: every window spec (the message's ``rows``).
    """
    return sum(int(r["rows"]) for r in body["late"] if window is None or r.get("window") == window)
