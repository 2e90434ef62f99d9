"""Splitting a window result into parts that fit the broker's packet limit; imports no MQTT.

A window with very many keys can encode to more bytes than the broker accepts (Mosquitto's
``max_packet_size``); publishing it anyway is refused every time, so the combiner splits it:

1. rows whose encoding alone exceeds the budget are taken out (``Oversized``): no packet can
   carry them, so the combiner dead-letters and counts them instead of retrying forever;
2. if the rest fits the budget, it is one message exactly as before (no ``part``/``parts``);
3. else the rows are sorted by key (and ``end``/``index`` for several windows of one key) and
   cut into ``parts`` equal row-count chunks, ``parts`` sized from the measured bytes per row
   and raised one at a time until every chunk fits.

Every step depends only on the rows' values and the budget, never on when or how often the
window is published, so a re-publication after a restart puts the same keys in the same part
and consumers deduplicate copies by ``(pipeline, window, start, partition, revision, part)``.
Header fields that vary between copies (``emitted_at``, ``watermark``) are kept out of the
measurement: the budget leaves ``HEADER_ROOM`` for the header.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

import msgpack
import numpy as np
import polars as pl

from shoal.processors.results import WindowResult, json_rows
from shoal.schemas.deadletter import DEADLETTER_HEADROOM

HEADER_ROOM: Final = 2048
"""Bytes of a window message kept for its header (names, numbers, ``part``/``parts``)."""

_SORT_BY: Final = ("key", "end", "index")


def body_budget(max_packet_size: int | None) -> int | None:
    """Bytes a window message's rows may take under a broker packet limit (None: no limit)."""
    if max_packet_size is None:
        return None
    return max(1, max_packet_size - DEADLETTER_HEADROOM - HEADER_ROOM)


def json_body_size(frame: pl.DataFrame) -> int:
    """Bytes of the ``results`` array of a JSON window message holding ``frame``."""
    return len(json_rows(WindowResult("", 0, 0, frame)))


def msgpack_body_size(frame: pl.DataFrame) -> int:
    """Bytes of the ``columns`` map of a MsgPack window message holding ``frame``."""
    packed = msgpack.packb({name: frame[name].to_list() for name in frame.columns})
    assert isinstance(packed, bytes)
    return len(packed)


BODY_SIZE: Final[dict[str, Callable[[pl.DataFrame], int]]] = {
    "json": json_body_size,
    "msgpack": msgpack_body_size,
}
"""How the body of each output encoding is measured."""


@dataclass(frozen=True, slots=True)
class Oversized:
    """A key's row that no message can carry: dead-letter it (``ResultTooLargeError``)."""

    key: str | None
    size: int
    row: pl.DataFrame


@dataclass(frozen=True, slots=True)
class Split:
    """What ``split_result`` makes of one window result for one encoding."""

    parts: list[WindowResult]
    oversized: list[Oversized]
    bodies: list[bytes] | None = None
    """Each part's JSON ``results`` array, when split from the rows' encoded lines."""


def split_result(
    result: WindowResult,
    budget: int | None,
    measure: Callable[[pl.DataFrame], int] = json_body_size,
    whole_size: int | None = None,
    lines: Sequence[bytes] | None = None,
) -> Split:
    """Cut ``result`` into parts whose bodies (``measure``) fit ``budget`` bytes each.

    ``whole_size``: ``measure(result.frame)`` if already known (the render-ahead). A result
    that fits is returned unchanged, as one part. ``lines``: for JSON, the rows already
    encoded (``results.ndjson_rows``, split into lines): the sizes are then added up and the
    parts' bodies joined from them (``Split.bodies``) instead of encoding every part again,
    the same parts and bytes.
    """
    frame = result.frame
    if budget is None or frame.height == 0:
        return Split([result], [])
    if lines is not None:
        return _split_lines(result, budget, lines)
    size = measure(frame) if whole_size is None else whole_size
    if size <= budget:
        return Split([result], [])
    frame, oversized = _take_oversized(frame, budget, measure)
    if oversized:
        if frame.height == 0:
            return Split([], oversized)
        size = measure(frame)
        if size <= budget:
            return Split([replace(result, frame=frame)], oversized)
    # the size does not depend on the order of the rows: no need to measure again
    frame = frame.sort([c for c in _SORT_BY if c in frame.columns], nulls_last=False)
    parts = max(2, math.ceil(size / budget))
    while True:
        chunks = _chunks(frame, parts)
        if all(measure(chunk) <= budget for chunk in chunks):
            break
        parts += 1
    return Split(
        [
            replace(result, frame=chunk, part=index, parts=len(chunks))
            for index, chunk in enumerate(chunks)
        ],
        oversized,
    )


def _split_lines(result: WindowResult, budget: int, lines: Sequence[bytes]) -> Split:
    """``split_result`` for JSON from the rows' lines.

    A body is ``[``, the lines joined by commas, ``]``: its size is their lengths added up.
    """
    frame = result.frame
    sizes = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
    if int(sizes.sum()) + len(lines) + 1 <= budget:
        return Split([result], [])
    rows = np.arange(len(lines))
    oversized = []
    if (sizes + 2 > budget).any():  # a row alone in a message: its line and the brackets
        big = np.flatnonzero(sizes + 2 > budget)
        keys = frame["key"].gather(big).to_list()
        oversized = [
            Oversized(None if k is None else str(k), int(sizes[i]) + 2, frame.slice(int(i), 1))
            for k, i in zip(keys, big.tolist(), strict=True)
        ]
        rows = np.flatnonzero(sizes + 2 <= budget)
        if len(rows) == 0:
            return Split([], oversized)
        frame = frame.filter(pl.Series(sizes + 2 <= budget))
        if int(sizes[rows].sum()) + len(rows) + 1 <= budget:
            body = b"[" + b",".join([lines[i] for i in rows.tolist()]) + b"]"
            return Split([replace(result, frame=frame)], oversized, [body])
    by = [c for c in _SORT_BY if c in frame.columns]
    whole = len(rows) == len(lines)  # no row taken out: ``rows`` is every line, in order
    if not (whole and by == ["key"] and _in_key_order(frame)):  # else sorted already
        order = frame.with_row_index("_row").sort(by, nulls_last=False)["_row"].to_numpy()
        frame, rows, whole = frame[order], rows[order], False
    total = int(sizes[rows].sum()) + len(rows) + 1
    parts = max(2, math.ceil(total / budget))
    while True:
        bounds = _bounds(len(rows), parts)
        if all(int(sizes[rows[a:b]].sum()) + (b - a) + 1 <= budget for a, b in bounds):
            break
        parts += 1
    return Split(
        [
            replace(result, frame=frame.slice(a, b - a), part=index, parts=len(bounds))
            for index, (a, b) in enumerate(bounds)
        ],
        oversized,
        [
            b"[" + b",".join(lines[a:b] if whole else [lines[i] for i in rows[a:b].tolist()]) + b"]"
            for a, b in bounds
        ],
    )


def _in_key_order(frame: pl.DataFrame) -> bool:
    """Whether sorting by ``key`` would leave every row where it is.

    No null key, and each key above the one before: a combiner's window frame can be (scenario
    B's, captured from an in-process combiner, was: it depends on the order the keys first
    arrived in), and sorting 100,000 rows and gathering their lines cost ~35 ms a step.
    """
    keys = frame["key"]
    if keys.null_count():
        return False
    return frame.height < 2 or bool((keys.slice(1) > keys.slice(0, frame.height - 1)).all())


def _bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """``_chunks``' row ranges: ``parts`` of equal row counts (the first ones one longer)."""
    parts = min(parts, rows)
    base, extra = divmod(rows, parts)
    out, offset = [], 0
    for index in range(parts):
        length = base + (1 if index < extra else 0)
        out.append((offset, offset + length))
        offset += length
    return out


def _chunks(frame: pl.DataFrame, parts: int) -> list[pl.DataFrame]:
    """``frame`` in ``parts`` chunks of equal row counts (the first ones one longer)."""
    return [frame.slice(a, b - a) for a, b in _bounds(frame.height, parts)]


def _take_oversized(
    frame: pl.DataFrame, budget: int, measure: Callable[[pl.DataFrame], int]
) -> tuple[pl.DataFrame, list[Oversized]]:
    """Rows whose body alone exceeds ``budget``, and the frame without them.

    A row's JSON line bounds its size in either encoding from above (JSON repeats the field
    names, MsgPack does not), so only rows whose line exceeds the budget are measured alone.
    """
    lines = frame.write_ndjson().encode().splitlines()
    suspects = [index for index, line in enumerate(lines) if len(line) + 2 > budget]
    oversized, drop = [], []
    for index in suspects:
        row = frame.slice(index, 1)
        size = measure(row)
        if size > budget:
            key = row["key"][0]
            oversized.append(Oversized(None if key is None else str(key), size, row))
            drop.append(index)
    if not drop:
        return frame, []
    return frame.filter(~pl.int_range(pl.len()).is_in(drop)), oversized
