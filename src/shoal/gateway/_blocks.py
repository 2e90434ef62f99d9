"""Measurement blocks for the gateway: input checks, the single-row buffer, concatenation.

The checks are the codec's own (``shoal.schemas._checks``), so a block that passes here is
one the pipeline's decoder accepts: a gateway never produces a batch that is dead-lettered.
Pure numpy/polars; never imports the broker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import InputError, SchemaError
from shoal.schemas import (
    ATTRIBUTE_COLUMNS,
    MAX_TS_MS,
    MIN_TS_MS,
    DecodeLimits,
    DictColumn,
    Measurements,
)
from shoal.schemas._checks import check_strings, check_timestamps, check_values

ColumnInput = str | Sequence[str | None] | npt.NDArray[Any] | pl.Series | None
"""An attribute for ``add_many``: one string for every row, one per row, or None."""


def as_schema_error(exc: InputError) -> SchemaError:
    """The same refusal as a ``SchemaError``.

    The codec reports some limits (string length) as ``DecodeError``; at the gateway every
    refusal of caller input is a ``SchemaError``.
    """
    if isinstance(exc, SchemaError):
        return exc
    err = SchemaError(
        exc.reason.replace("_", " "),
        reason=exc.reason,
        field=exc.field,
        row=exc.row,
        expected=exc.expected,
        found=exc.found,
    )
    err.__cause__ = exc
    return err


class BlockChecker:
    """Checks blocks against the wire contract; remembers dictionaries it has already checked.

    A producer such as ``SensorField`` reuses one sensor-id tuple for every block, so its
    dictionary is checked once, not on every call.
    """

    def __init__(self, limits: DecodeLimits) -> None:
        self.limits = limits
        self._checked: dict[int, tuple[tuple[str | None, ...], bool]] = {}

    def check(self, block: Measurements, now_ms: int | None) -> None:
        """Raise ``SchemaError`` unless every row of ``block`` is valid."""
        try:
            check_values(block.value)
            check_timestamps(block.ts, self.limits, now_ms)
            self._check_dict(block.sensor_id, "sensor_id", nullable=False)
            for name, column in block.attributes.items():
                self._check_dict(column, name, nullable=True)
        except InputError as exc:
            raise as_schema_error(exc) from None

    def _check_dict(self, column: DictColumn, name: str, *, nullable: bool) -> None:
        codes = column.codes
        if len(codes) and int(codes.max()) >= len(column.values):
            row = int(np.argmax(codes >= len(column.values)))
            raise SchemaError(
                "dictionary code out of range",
                reason="bad_code",
                field=name,
                row=row,
                expected=f"< {len(column.values)} (the dictionary size)",
                found=str(int(codes[row])),
            )
        seen = self._checked.get(id(column.values))
        if seen is not None and seen[0] is column.values and seen[1] == nullable:
            return

        def first_row(index: int) -> int | None:
            hits = np.flatnonzero(codes == index)
            return int(hits[0]) if len(hits) else None

        strings = pl.Series(name, column.values, dtype=pl.String)
        check_strings(strings, name, self.limits, nullable=nullable, row_of=first_row)
        if len(self._checked) > 64:  # producers with ever-new dictionaries: stay bounded
            self._checked.clear()
        # Keep a reference to the tuple so its id cannot be reused by another object.
        self._checked[id(column.values)] = (column.values, nullable)


def block_from_columns(
    sensor_ids: str | Sequence[str] | npt.NDArray[Any] | pl.Series,
    ts: Sequence[int] | npt.NDArray[Any] | pl.Series,
    values: Sequence[float] | npt.NDArray[Any] | pl.Series,
    attributes: dict[str, ColumnInput],
) -> Measurements:
    """A block from caller columns (numpy arrays, polars series or sequences), vectorised.

    Raises:
        SchemaError: mismatched lengths, wrong types or out-of-range timestamps.
    """
    ts_array = _timestamps(ts)
    n = len(ts_array)
    value_array = _values(values, n)
    frame_columns = [
        _strings("sensor_id", sensor_ids, n),
        pl.Series("ts", ts_array, dtype=pl.Int64),
        pl.Series("value", value_array, dtype=pl.Float64),
    ]
    for name in ATTRIBUTE_COLUMNS:
        column = attributes.get(name)
        if column is not None:
            frame_columns.append(_strings(name, column, n))
    frame = pl.DataFrame(frame_columns)
    if frame.get_column("sensor_id").null_count():
        row = int(frame.get_column("sensor_id").is_null().arg_true()[0])
        raise SchemaError(
            "missing sensor id", reason="null_value", field="sensor_id", row=row, found="null"
        )
    return Measurements.from_frame(frame)


def _timestamps(ts: Sequence[int] | npt.NDArray[Any] | pl.Series) -> npt.NDArray[np.int64]:
    array = ts.to_numpy() if isinstance(ts, pl.Series) else np.asarray(ts)
    if array.ndim != 1:
        raise SchemaError("ts must be one-dimensional", reason="bad_type", field="ts")
    kind = array.dtype.kind
    if kind == "M":  # datetime64: convert to epoch milliseconds
        return array.astype("datetime64[ms]").astype(np.int64)
    if kind == "f":
        finite = np.isfinite(array)
        whole = finite & (np.floor(np.where(finite, array, 0.0)) == array)
        if not whole.all():
            row = int(np.argmin(whole))
            raise SchemaError(
                "timestamp is not a whole number of milliseconds",
                reason="bad_type",
                field="ts",
                row=row,
                expected="integer epoch milliseconds",
                found=repr(float(array[row])),
            )
        _check_ts_range(array)
        return array.astype(np.int64)
    if kind in "iu":
        _check_ts_range(array)
        return array.astype(np.int64, copy=False)
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64)
    raise SchemaError(
        "wrong type",
        reason="bad_type",
        field="ts",
        expected="integer epoch milliseconds",
        found=f"an array of {array.dtype}",
    )


def _check_ts_range(array: npt.NDArray[Any]) -> None:
    if len(array) == 0:
        return
    bad = (array < MIN_TS_MS) | (array > MAX_TS_MS)
    if bad.any():
        row = int(np.argmax(bad))
        raise SchemaError(
            "timestamp out of range",
            reason="out_of_range",
            field="ts",
            row=row,
            expected=f"integer in [{MIN_TS_MS}, {MAX_TS_MS}]",
            found=str(array[row]),
        )


def _values(values: Sequence[float] | npt.NDArray[Any] | pl.Series, n: int) -> npt.NDArray[Any]:
    raw = values.to_numpy() if isinstance(values, pl.Series) else np.asarray(values)
    if raw.dtype.kind not in "fiu" and not (raw.dtype.kind == "O" and len(raw) == 0):
        raise SchemaError(
            "wrong type",
            reason="bad_type",
            field="value",
            expected="numbers",
            found=f"an array of {raw.dtype}",
        )
    if raw.shape != (n,):
        raise SchemaError(
            "columns differ in length",
            reason="length_mismatch",
            field="value",
            expected=f"{n} values (one per timestamp)",
            found=f"shape {raw.shape}",
        )
    return raw.astype(np.float64, copy=False)


def _strings(name: str, column: Any, n: int) -> pl.Series:
    if isinstance(column, str):
        return pl.Series(name, [column], dtype=pl.String).new_from_index(0, n)
    if isinstance(column, np.ndarray) and column.dtype.kind not in "UO":
        raise SchemaError(
            "wrong type",
            reason="bad_type",
            field=name,
            expected="strings",
            found=f"an array of {column.dtype}",
        )
    try:
        series = pl.Series(name, column, dtype=pl.String, strict=True)
    except (TypeError, pl.exceptions.PolarsError) as exc:
        raise SchemaError(
            "wrong type", reason="bad_type", field=name, expected="strings", found=str(exc)[:80]
        ) from exc
    if series.len() != n:
        raise SchemaError(
            "columns differ in length",
            reason="length_mismatch",
            field=name,
            expected=f"{n} entries (one per timestamp)",
            found=f"{series.len()}",
        )
    return series


class RowBuffer:
    """Rows added one at a time, kept as Python lists until they become a block."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.sensor_id: list[str] = []
        self.ts: list[int] = []
        self.value: list[float] = []
        self.attributes: dict[str, list[str | None]] = {name: [] for name in ATTRIBUTE_COLUMNS}
        self.has_attribute = dict.fromkeys(ATTRIBUTE_COLUMNS, False)
        self.first_at_s: float | None = None

    def __len__(self) -> int:
        return len(self.ts)

    def append(
        self, sensor_id: str, ts: int, value: float, attrs: tuple[str | None, ...], now_s: float
    ) -> None:
        """Append one (already checked) row."""
        if self.first_at_s is None:
            self.first_at_s = now_s
        self.sensor_id.append(sensor_id)
        self.ts.append(ts)
        self.value.append(value)
        for name, attr in zip(ATTRIBUTE_COLUMNS, attrs, strict=True):
            self.attributes[name].append(attr)
            if attr is not None:
                self.has_attribute[name] = True

    def take(self) -> tuple[Measurements, float] | None:
        """The buffered rows as a block, with the time the first of them arrived."""
        if not self.ts or self.first_at_s is None:
            return None
        columns = [
            pl.Series("sensor_id", self.sensor_id, dtype=pl.String),
            pl.Series("ts", self.ts, dtype=pl.Int64),
            pl.Series("value", self.value, dtype=pl.Float64),
        ]
        columns.extend(
            pl.Series(name, self.attributes[name], dtype=pl.String)
            for name in ATTRIBUTE_COLUMNS
            if self.has_attribute[name]
        )
        block = Measurements.from_frame(pl.DataFrame(columns))
        first = self.first_at_s
        self._reset()
        return block, first


def check_row(
    sensor_id: Any, ts: Any, value: Any, attrs: tuple[Any, ...], limits: DecodeLimits
) -> tuple[int, float]:
    """Check one row for ``Gateway.add``; returns (ts, value) as int and float.

    Raises:
        SchemaError: the row breaks the wire contract.
    """
    if isinstance(ts, bool) or not isinstance(ts, int | np.integer):
        raise SchemaError(
            "wrong type",
            reason="bad_type",
            field="ts",
            expected="integer epoch milliseconds",
            found=type(ts).__name__,
        )
    ts_int = int(ts)
    if not MIN_TS_MS <= ts_int <= MAX_TS_MS:
        raise SchemaError(
            "timestamp out of range",
            reason="out_of_range",
            field="ts",
            expected=f"integer in [{MIN_TS_MS}, {MAX_TS_MS}]",
            found=str(ts_int),
        )
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise SchemaError(
            "wrong type", reason="bad_type", field="value", expected="a number", found=repr(value)
        )
    value_float = float(value)
    if not np.isfinite(value_float):
        raise SchemaError(
            "value is not finite",
            reason="not_finite",
            field="value",
            expected="a finite float64",
            found=repr(value_float),
        )
    for name, text, nullable in (
        ("sensor_id", sensor_id, False),
        *zip(ATTRIBUTE_COLUMNS, attrs, (True,) * len(attrs), strict=True),
    ):
        if text is None and nullable:
            continue
        if not isinstance(text, str):
            raise SchemaError(
                "wrong type", reason="bad_type", field=name, expected="a string", found=repr(text)
            )
        size = len(text.encode("utf-8", "surrogatepass"))
        if size == 0:
            raise SchemaError(
                "empty string",
                reason="empty_string",
                field=name,
                expected="a non-empty string",
                found="''",
            )
        if size > limits.max_string_bytes:
            raise SchemaError(
                "string too long",
                reason="string_too_long",
                field=name,
                expected=f"at most {limits.max_string_bytes} UTF-8 bytes",
                found=f"{size} bytes",
            )
    return ts_int, value_float


_EMPTY_CODES: Final = np.zeros(0, dtype=np.uint32)


def empty_block() -> Measurements:
    """A block of no rows (the body of the empty batches that keep seqs contiguous)."""
    return Measurements(
        DictColumn((), _EMPTY_CODES), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    )


def concat_blocks(blocks: Sequence[Measurements]) -> Measurements:
    """One block holding the rows of ``blocks`` in order.

    Blocks that share a dictionary (the same tuple object, as one producer's blocks do) are
    joined by concatenating their codes; different dictionaries are merged entry by entry,
    never row by row.
    """
    blocks = [b for b in blocks if len(b)]
    if not blocks:
        return empty_block()
    if len(blocks) == 1:
        return blocks[0]
    sensor_id = _concat_column([b.sensor_id for b in blocks], [len(b) for b in blocks])
    names = [n for n in ATTRIBUTE_COLUMNS if any(n in b.attributes for b in blocks)]
    attributes = {
        name: _concat_column([b.attributes.get(name) for b in blocks], [len(b) for b in blocks])
        for name in names
    }
    return Measurements(
        sensor_id=sensor_id,
        ts=np.concatenate([b.ts for b in blocks]),
        value=np.concatenate([b.value for b in blocks]),
        attributes=attributes,
    )


def _concat_column(columns: Sequence[DictColumn | None], lengths: Sequence[int]) -> DictColumn:
    first = columns[0]
    if first is not None and all(c is not None and c.values is first.values for c in columns):
        return DictColumn(first.values, np.concatenate([c.codes for c in columns if c]))
    merged: dict[str | None, int] = {}
    lookups: dict[int, npt.NDArray[np.uint32]] = {}
    parts: list[npt.NDArray[np.uint32]] = []
    for column, n in zip(columns, lengths, strict=True):
        if column is None:  # a block without this attribute: all rows null
            parts.append(np.full(n, merged.setdefault(None, len(merged)), dtype=np.uint32))
            continue
        lookup = lookups.get(id(column.values))
        if lookup is None:
            lookup = np.fromiter(
                (merged.setdefault(v, len(merged)) for v in column.values),
                dtype=np.uint32,
                count=len(column.values),
            )
            lookups[id(column.values)] = lookup
        parts.append(lookup[column.codes])
    return DictColumn(tuple(merged), np.concatenate(parts))
