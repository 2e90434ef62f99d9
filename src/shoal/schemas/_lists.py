"""Python lists from a JSON or MsgPack parser → one strictly typed ``FRAME_SCHEMA`` DataFrame.

Type checks run over whole columns (``set(map(type, ...))`` and polars' strict constructors);
only the error path walks rows, to name the first offending one.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Final, NoReturn

import polars as pl

from shoal.errors import SchemaError
from shoal.schemas._checks import check_keys, check_row_count, describe
from shoal.schemas._model import ATTRIBUTE_COLUMNS, FRAME_SCHEMA, DecodeLimits, null_strings

REQUIRED_FIELDS: Final = frozenset({"sensor_id", "ts", "value"})
ALL_FIELDS: Final = frozenset(FRAME_SCHEMA.names())

_NONE_TYPE: Final = type(None)
_ALLOWED_TYPES: Final[dict[str, frozenset[type]]] = {
    "sensor_id": frozenset({str}),
    "ts": frozenset({int}),
    "value": frozenset({int, float}),
    **{name: frozenset({str, _NONE_TYPE}) for name in ATTRIBUTE_COLUMNS},
}
_EXPECTED: Final = {
    "sensor_id": "string",
    "ts": "integer epoch milliseconds",
    "value": "number",
    **dict.fromkeys(ATTRIBUTE_COLUMNS, "string or null"),
}


def frame_from_rows(rows: Any, limits: DecodeLimits) -> pl.DataFrame:
    """Decode a list of row maps (``{"sensor_id": ..., "ts": ..., "value": ...}``)."""
    if not isinstance(rows, list):
        raise SchemaError(
            "wrong type",
            reason="bad_type",
            field="rows",
            expected="array of rows",
            found=describe(rows),
        )
    check_row_count(len(rows), limits)
    if set(map(type, rows)) - {dict}:
        row = next(i for i, r in enumerate(rows) if type(r) is not dict)
        raise SchemaError(
            "row is not a map",
            reason="bad_type",
            field="rows",
            row=row,
            expected="map",
            found=describe(rows[row]),
        )
    columns: dict[str, list[Any]] = {}
    try:
        for name in REQUIRED_FIELDS:
            columns[name] = list(map(itemgetter(name), rows))
    except KeyError:
        _raise_bad_keys(rows)
    if set(map(len, rows)) != {len(REQUIRED_FIELDS)}:
        # Some rows carry attributes (or unknown keys): check key sets exactly, then collect.
        if any(keys - ALL_FIELDS for keys in set(map(frozenset, rows))):
            _raise_bad_keys(rows)
        for name in ATTRIBUTE_COLUMNS:
            column = [r.get(name) for r in rows]
            if column.count(None) < len(column):
                columns[name] = column
    return frame_from_columns(columns, len(rows))


def _raise_bad_keys(rows: list[dict[str, Any]]) -> NoReturn:
    for row, r in enumerate(rows):
        check_keys(r, ALL_FIELDS, REQUIRED_FIELDS, "a row", row=row)
    raise AssertionError("unreachable: a row with bad keys was expected")


def frame_from_columns(columns: dict[str, list[Any]], n: int) -> pl.DataFrame:
    """Build the frame from per-field lists of length ``n`` (absent attributes become null)."""
    series = []
    for name, dtype in FRAME_SCHEMA.items():
        values = columns.get(name)
        if values is None:
            if name in REQUIRED_FIELDS:
                raise SchemaError(
                    "missing column",
                    reason="missing_field",
                    field=name,
                    expected="present",
                    found="absent",
                )
            series.append(null_strings(name, n))
            continue
        if len(values) != n:
            raise SchemaError(
                "column length differs from the row count",
                reason="length_mismatch",
                field=name,
                expected=f"{n} entries",
                found=f"{len(values)}",
            )
        series.append(_typed_series(name, values, dtype))
    return pl.DataFrame(series)


def _typed_series(name: str, values: list[Any], dtype: pl.DataType) -> pl.Series:
    allowed = _ALLOWED_TYPES[name]
    try:
        series = pl.Series(name, values, dtype=dtype, strict=True)
    except (TypeError, ValueError, OverflowError, pl.exceptions.PolarsError):
        if not set(map(type, values)) <= allowed:
            _raise_wrong_type(name, values, allowed)
        row, found = _first_unrepresentable(values, dtype)
        raise SchemaError(
            "number out of range",
            reason="out_of_range",
            field=name,
            row=row,
            expected="a signed 64-bit integer" if dtype == pl.Int64 else "a float64",
            found=found,
        ) from None
    if series.dtype != dtype:
        # polars reads a column of tuples (MsgPack extension values) as a struct, whatever
        # dtype it was asked for.
        _raise_wrong_type(name, values, allowed)
    if dtype == pl.String:
        return series  # the strict constructor refused every non-string; nulls checked later
    # Numbers: the strict constructor lets nulls through and turns booleans into 0 or 1.
    # Only a column holding a 0 or 1 can hide a boolean, so only those get a type scan.
    if series.null_count():
        _raise_wrong_type(name, values, allowed)
    numbers = series.to_numpy()
    if ((numbers == 0) | (numbers == 1)).any() and bool in set(map(type, values)):
        _raise_wrong_type(name, values, allowed)
    return series


def _raise_wrong_type(name: str, values: list[Any], allowed: frozenset[type]) -> NoReturn:
    row = next(i for i, v in enumerate(values) if type(v) not in allowed)
    raise SchemaError(
        "wrong type",
        reason="bad_type",
        field=name,
        row=row,
        expected=_EXPECTED[name],
        found=describe(values[row]),
    )


def _first_unrepresentable(values: list[Any], dtype: pl.DataType) -> tuple[int | None, str]:
    limit = 2**63 if dtype == pl.Int64 else 2**1024
    for i, v in enumerate(values):
        if type(v) is int and not -limit <= v < limit:
            return i, str(v)
    return None, "a number polars cannot represent"
