"""SQL expressions (``pl.sql_expr``) over batch rows and window results, checked at deploy.

A pipeline's row stage is ``derive`` (named expressions computing columns, in order, each
seeing the columns before it) then ``where`` (a boolean expression); its result stage is
``having`` over a window result row. Every expression is compiled once and run against an
empty and a small sample frame of the exact schema it will meet, so an unknown column, a
type error, a non-boolean condition or an expression that looks across rows (an aggregate
or ``OVER``: its answer would depend on how rows were cut into batches) is refused when the
spec is parsed, with the expression and the column named. Nothing here loops over rows.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import ConfigError, FunctionError
from shoal.rules.functions import SAMPLE_ROWS, Udf, UdfCall, check_udf, parse_call
from shoal.schemas import FRAME_SCHEMA

PROTECTED_COLUMNS: Final = frozenset({"sensor_id", "ts"})
"""Columns ``derive`` may not replace: a row's identity and event time."""

RESULT_BASE_SCHEMA: Final = pl.Schema(
    {
        "window": pl.String(),
        "start": pl.Int64(),
        "end": pl.Int64(),
        "key": pl.String(),
        "rows": pl.Int64(),
        "batches": pl.Int64(),
    }
)
"""Columns of every window result row besides the aggregates (``state.ClosedWindows``)."""

RULE_REASONS: Final = frozenset(
    {
        "bad_expression",
        "unknown_column",
        "wrong_type",
        "not_per_row",
        "bad_name",
        "protected_column",
    }
)
"""The ``ConfigError.reason`` codes of a refused expression (the control plane reports them
as ``invalid_expression``, naming the field)."""

_NAME: Final = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
_SAMPLE_ROWS: Final = 3


@dataclass(frozen=True, slots=True)
class RowsKept:
    """A batch frame after the row stage, and how many rows it removed.

    Attributes:
        frame: the kept rows (``FRAME_SCHEMA`` columns first, derived ones after).
        filtered: rows ``where`` removed (false or null).
        invalid: rows whose derived ``value`` was null or not finite (removed, counted).
        mask: per input row, whether it was kept (None: every row was).
    """

    frame: pl.DataFrame
    filtered: int
    invalid: int
    mask: pl.Series | None = None


@dataclass(frozen=True, slots=True)
class RowRules:
    """A pipeline's compiled row stage: ``derive`` then ``where``, as one polars plan.

    Attributes:
        where: the condition's text (None: every row passes).
        derive: (column, expression text) in order.
    """

    where: str | None
    derive: tuple[tuple[str, str], ...]
    _derive: tuple[pl.Expr | _UdfStep, ...] = field(compare=False, repr=False)
    _where: pl.Expr | UdfCall | None = field(compare=False, repr=False)

    @property
    def inputs(self) -> frozenset[str]:
        """The batch columns (``FRAME_SCHEMA``) the stage reads: a worker builds only these."""
        names: set[str] = set()
        for step in (*self._derive, self._where):
            if isinstance(step, pl.Expr):
                names.update(step.meta.root_names())
            elif isinstance(step, _UdfStep):
                names.update(step.call.args)
            elif isinstance(step, UdfCall):
                names.update(step.args)
        return frozenset(names & set(FRAME_SCHEMA.names()))

    @property
    def calls_functions(self) -> bool:
        """Whether a step calls a user function (the worker runs it under a budget)."""
        return isinstance(self._where, UdfCall) or any(
            isinstance(step, _UdfStep) for step in self._derive
        )

    def derives(self, column: str) -> bool:
        """Whether ``derive`` computes ``column``."""
        return any(name == column for name, _ in self.derive)

    def apply(self, frame: pl.DataFrame, columns: Collection[str] | None = None) -> RowsKept:
        """The rows that pass, with derived columns; vectorised over the whole batch.

        ``columns``: the columns the caller reads from the kept rows (None: every column);
        the others are not filtered (a batch's string columns cost the most to filter).
        Without user functions the whole stage is one polars plan: the derived columns, the
        finite-value check and the condition are computed in a single ``collect`` (each
        ``with_columns``/``select`` of its own would cost a query per step); the counts and
        the filter then work on the two boolean columns.
        """
        if not self.calls_functions:
            return self._apply_plan(frame, columns)
        out = frame
        for step in self._derive:
            out = out.with_columns(step.evaluate(out) if isinstance(step, _UdfStep) else step)
        valid = None
        if self.derives("value"):  # a derived value is checked finite per row
            value = out.get_column("value")
            valid = (value.is_not_null() & value.is_finite().fill_null(value=False)).to_numpy()
        passing = None
        if self._where is not None:
            passing = (
                self._where.evaluate(out).fill_null(value=False)
                if isinstance(self._where, UdfCall)
                else out.select(self._where.fill_null(value=False)).to_series()
            ).to_numpy()
        if columns is not None:
            out = out.select(n for n in out.columns if n in columns)
        return _kept(out, valid, passing)

    def _apply_plan(self, frame: pl.DataFrame, columns: Collection[str] | None) -> RowsKept:
        """``apply`` for a stage of SQL expressions only, without per-step Series operations.

        The derived columns, then the checks and the columns wanted in one ``select``. Eager
        steps, not one lazy plan: polars' optimiser may fuse the steps of a plan and
        round differently (25.842777777777776 for 25.842777777777773 was seen), and a
        pipeline's results must be the bits its expressions give row by row.
        """
        out = frame
        for step in self._derive:
            assert isinstance(step, pl.Expr)
            out = out.with_columns(step)
        checks: list[pl.Expr] = []
        if self.derives("value"):
            value = pl.col("value")
            checks.append((value.is_not_null() & value.is_finite()).fill_null(value=False))
        if self._where is not None:
            assert isinstance(self._where, pl.Expr)
            checks.append(self._where.fill_null(value=False))
        names = [f"__shoal_check_{i}" for i in range(len(checks))]
        out = out.select(
            *(n for n in out.columns if columns is None or n in columns),
            *(check.alias(name) for check, name in zip(checks, names, strict=True)),
        )
        if not checks:
            return RowsKept(out, 0, 0, None)
        masks = [out.get_column(name).to_numpy() for name in names]
        out = pl.DataFrame([out.get_column(n) for n in out.columns[: -len(names)]])
        valid = masks.pop(0) if self.derives("value") else None
        return _kept(out, valid, masks[0] if masks else None)


def _kept(
    out: pl.DataFrame, valid: npt.NDArray[np.bool_] | None, passing: npt.NDArray[np.bool_] | None
) -> RowsKept:
    """The rows of ``out`` whose value is valid and that pass ``where`` (None: all), counted."""
    invalid = 0 if valid is None else out.height - int(np.count_nonzero(valid))
    if valid is None and passing is None:
        return RowsKept(out, 0, invalid, None)
    keep = passing if valid is None else valid if passing is None else valid & passing
    assert keep is not None
    kept = int(np.count_nonzero(keep))
    filtered = out.height - invalid - kept
    if kept == out.height:
        return RowsKept(out, filtered, invalid, None)
    mask = pl.Series(keep)
    return RowsKept(out.filter(mask), filtered, invalid, mask)


@dataclass(frozen=True, slots=True)
class _UdfStep:
    """A ``derive`` column computed by a UDF call, cast to the column's type."""

    name: str
    call: UdfCall
    dtype: pl.DataType

    def evaluate(self, frame: pl.DataFrame) -> pl.Series:
        out = self.call.evaluate(frame)
        try:
            return out.cast(self.dtype).alias(self.name)
        except pl.exceptions.PolarsError as exc:  # e.g. a string UDF into a numeric column
            raise FunctionError(
                f"function {self.call.udf.spec.name!r}: its result cannot be {self.name}",
                reason="function_bad_result",
                field=f"derive.{self.name}",
                expected=str(self.dtype),
                found=str(out.dtype),
            ) from exc


@dataclass(frozen=True, slots=True)
class Having:
    """A compiled ``having`` condition over window result rows."""

    text: str
    expr: pl.Expr = field(compare=False, repr=False)

    def apply(self, frame: pl.DataFrame) -> pl.DataFrame:
        """The result rows that pass (false or null: withheld)."""
        if frame.height == 0:
            return frame
        return frame.filter(self.expr)


def compile_row_rules(
    where: str | None,
    derive: Mapping[str, str] | tuple[tuple[str, str], ...],
    udfs: Mapping[str, Udf] | None = None,
) -> RowRules | None:
    """Compile and check a row stage against the decoded batch schema (None: no rules).

    An expression that is one call of a UDF in ``udfs`` on columns (``f(value, ts)``) runs
    the function instead of SQL; it is run once on sample rows here.

    Raises:
        ConfigError: ``field`` is ``derive.<name>`` or ``where``; ``reason`` is
            ``bad_expression``, ``unknown_column``, ``wrong_type`` or ``not_per_row``.
    """
    pairs = tuple(derive.items()) if isinstance(derive, Mapping) else derive
    if where is None and not pairs:
        return None
    schema = dict(FRAME_SCHEMA)
    compiled: list[pl.Expr | _UdfStep] = []
    for name, text in pairs:
        field = f"derive.{name}"
        if not _NAME.match(name):
            raise ConfigError(
                f"derive: {name!r} (= {text!r}) is not a column name (lower case letters, "
                "digits and _, "
                "starting with a letter or _)",
                field=field,
                reason="bad_name",
            )
        if name in PROTECTED_COLUMNS:
            raise ConfigError(
                f"derive: {name!r} (= {text!r}) may not be replaced (sensor_id and ts are a "
                "row's identity and event time)",
                field=field,
                reason="protected_column",
            )
        call = parse_call(text, udfs or {})
        if call is not None:
            step = _udf_step(name, text, call, pl.Schema(schema))
            schema[name] = step.dtype
            compiled.append(step)
            continue
        expr = _compile(text, field).alias(name)
        dtype = _check(expr, text, field, pl.Schema(schema))
        if name == "value" and not dtype.is_numeric():
            raise _wrong_type(field, text, f"a number for value, not {dtype}")
        if name in FRAME_SCHEMA and name != "value" and dtype != FRAME_SCHEMA[name]:
            expr = expr.cast(FRAME_SCHEMA[name])
            dtype = FRAME_SCHEMA[name]
        if name == "value":
            expr = expr.cast(pl.Float64)
            dtype = pl.Float64()
        schema[name] = dtype
        compiled.append(expr)
    where_expr: pl.Expr | UdfCall | None = None
    where_call = None if where is None else parse_call(where, udfs or {})
    if where_call is not None:
        assert where is not None
        dtype = check_udf(where_call, _sample(pl.Schema(schema), SAMPLE_ROWS), "where")
        if dtype != pl.Boolean:
            raise _wrong_type("where", where, f"a condition (returns = 'bool'), not {dtype}")
        where_expr = where_call
    elif where is not None:
        where_expr = _compile(where, "where")
        dtype = _check(where_expr, where, "where", pl.Schema(schema))
        if dtype != pl.Boolean:
            raise _wrong_type("where", where, f"a condition (true/false), not {dtype}")
    return RowRules(where, pairs, tuple(compiled), where_expr)


def _udf_step(name: str, text: str, call: UdfCall, schema: pl.Schema) -> _UdfStep:
    """A derive column computed by ``call``, run once on sample rows of ``schema``."""
    field = f"derive.{name}"
    dtype = check_udf(call, _sample(schema, SAMPLE_ROWS), field)
    if name == "value" and not dtype.is_numeric():
        raise _wrong_type(field, text, f"a number for value, not {dtype}")
    if name in FRAME_SCHEMA:  # value is Float64, attributes keep their type
        dtype = pl.Float64() if name == "value" else FRAME_SCHEMA[name]
    return _UdfStep(name, call, dtype)


def compile_having(
    text: str, aggregates: Mapping[str, pl.DataType], *, field: str = "having"
) -> Having:
    """Compile and check a condition over window result rows (``having``, alert conditions).

    Their columns are ``RESULT_BASE_SCHEMA`` and the aggregates by output name.

    Raises:
        ConfigError: ``field`` as given, reasons as for ``compile_row_rules``.
    """
    schema = pl.Schema({**RESULT_BASE_SCHEMA, **aggregates})
    expr = _compile(text, field)
    dtype = _check(expr, text, field, schema)
    if dtype != pl.Boolean:
        raise _wrong_type(field, text, f"a condition (true/false), not {dtype}")
    return Having(text, expr)


def _compile(text: str, field: str) -> pl.Expr:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"{field}: expected a SQL expression (a non-empty string)",
            field=field,
            reason="bad_expression",
        )
    try:
        return pl.sql_expr(text)
    except Exception as exc:  # polars raises several SQL error types: wrap them all
        raise ConfigError(
            f"{field}: cannot parse {text!r}: {_first_line(exc)}",
            field=field,
            reason="bad_expression",
        ) from exc


def _check(expr: pl.Expr, text: str, field: str, schema: pl.Schema) -> pl.DataType:
    """Run ``expr`` on an empty and a sample frame of ``schema``; its output type."""
    if ".over(" in str(expr):
        raise _not_per_row(field, text)
    try:
        empty = pl.DataFrame(schema=schema).select(expr)
        sample = _sample(schema).select(expr)
    except pl.exceptions.ColumnNotFoundError as exc:
        column = _missing_column(exc)
        raise ConfigError(
            f"{field}: {text!r} names unknown column {column!r}; available: "
            f"{', '.join(schema.names())}",
            field=field,
            reason="unknown_column",
        ) from exc
    except Exception as exc:  # type errors, unsupported functions: say which expression
        raise ConfigError(
            f"{field}: {text!r} cannot be computed on {', '.join(schema.names())}: "
            f"{_first_line(exc)}",
            field=field,
            reason="wrong_type",
        ) from exc
    if sample.height != _SAMPLE_ROWS:
        raise _not_per_row(field, text)
    return empty.to_series().dtype


def _sample(schema: pl.Schema, rows: int = _SAMPLE_ROWS) -> pl.DataFrame:
    """A few rows of ``schema`` with distinct values (an aggregate collapses them)."""
    columns: dict[str, pl.Series] = {}
    for name, dtype in schema.items():
        if dtype == pl.String:
            values: list[object] = [f"{name}-{i}" for i in range(rows)]
        elif dtype.is_float():
            values = [float(v) for v in np.linspace(1.0, 2.0, rows)]
        elif dtype == pl.Boolean:
            values = [i % 2 == 0 for i in range(rows)]
        else:
            values = list(range(1, rows + 1))
        columns[name] = pl.Series(name, values, dtype=dtype)
    return pl.DataFrame(columns)


def _missing_column(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else "?"
    match = re.search(r'"([^"]+)"', text) or re.search(r"'([^']+)'", text)
    return match.group(1) if match else text


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _wrong_type(field: str, text: str, wanted: str) -> ConfigError:
    return ConfigError(f"{field}: {text!r} must give {wanted}", field=field, reason="wrong_type")


def _not_per_row(field: str, text: str) -> ConfigError:
    return ConfigError(
        f"{field}: {text!r} looks across rows (an aggregate or OVER); rules are per row, "
        "since a batch is an arbitrary cut of the data (use aggregates and having for that)",
        field=field,
        reason="not_per_row",
    )
