"""SQL expressions (``pl.sql_expr``) over batch rows and window results, checked at deploy.

A pipeline's row stage is ``derive`` (named expressions computing columns, in order, each
seeing the columns before it) then ``where`` (a boolean expression); its result stage is
``having`` over a window result row. Every expression is compiled once and run against an
empty and a small sample frame of the exact schema it will meet, so an unknown column, a
type error, a non-boolean condition or an expression that looks across rows (an aggregate
or ``OVER``: its answer would depend on how rows were cut into batches) is refused when the
spec is parsed, with the expression and the column named. Nothing here loops over rows.
Calls of the pipeline's Python UDFs inside an expression are found and computed by
``rules.calls``; the rest stays polars SQL.
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
from shoal.rules.calls import Call, Rewritten, across_rows, is_hidden, rewrite
from shoal.rules.functions import SAMPLE_ROWS, Udf
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
        "unknown_function",
        "wrong_arity",
        "shadowed_function",
    }
)
"""The ``ConfigError.reason`` codes of a refused expression (the control plane reports them
as ``invalid_expression``, naming the field)."""

_NAME: Final = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
_SAMPLE_ROWS: Final = 3
_UNKNOWN_FUNCTION: Final = re.compile(
    r"unsupported (?:SQL )?function[^A-Za-z_]*([A-Za-z_]\w*)", re.I
)


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
    _derive: tuple[pl.Expr | _Calling, ...] = field(compare=False, repr=False)
    _where: pl.Expr | _Calling | None = field(compare=False, repr=False)

    @property
    def inputs(self) -> frozenset[str]:
        """The batch columns (``FRAME_SCHEMA``) the stage reads: a worker builds only these."""
        names: set[str] = set()
        for step in (*self._derive, self._where):
            if isinstance(step, pl.Expr):
                names.update(step.meta.root_names())
            elif isinstance(step, _Calling):
                names.update(step.inputs)
        return frozenset(names & set(FRAME_SCHEMA.names()))

    @property
    def calls_functions(self) -> bool:
        """Whether a step calls a user function (the worker runs it under a budget)."""
        return isinstance(self._where, _Calling) or any(
            isinstance(step, _Calling) for step in self._derive
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
        the filter then work on the two boolean columns. With them, each step first adds
        the hidden columns of its UDF calls (``rules.calls``), dropped at the end.
        """
        if not self.calls_functions:
            return self._apply_plan(frame, columns)
        out = frame
        for step in self._derive:
            if isinstance(step, _Calling):
                out = step.with_calls(out)
            out = out.with_columns(step.expr if isinstance(step, _Calling) else step)
        valid = None
        if self.derives("value"):  # a derived value is checked finite per row
            value = out.get_column("value")
            valid = (value.is_not_null() & value.is_finite().fill_null(value=False)).to_numpy()
        passing = None
        if self._where is not None:
            condition = self._where
            if isinstance(condition, _Calling):
                out = condition.with_calls(out)
                condition = condition.expr
            passing = out.select(condition.fill_null(value=False)).to_series().to_numpy()
        out = out.select(
            n for n in out.columns if not is_hidden(n) and (columns is None or n in columns)
        )
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
class _Calling:
    """A step whose expression calls UDFs: their hidden columns, then the SQL over them."""

    calls: tuple[Call, ...]
    expr: pl.Expr

    @property
    def inputs(self) -> set[str]:
        """The columns its arguments and its expression read (hidden ones included)."""
        names = set(self.expr.meta.root_names())
        for call in self.calls:
            for arg in call.args:
                names.update(arg.meta.root_names())
        return names

    def with_calls(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` with the hidden column of each call, inner calls first.

        Raises:
            FunctionError: a UDF failed on the batch.
        """
        for call in self.calls:
            frame = frame.with_columns(call.evaluate(frame))
        return frame


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
    udafs: Collection[str] = (),
) -> RowRules | None:
    """Compile and check a row stage against the decoded batch schema (None: no rules).

    An expression may call the UDFs in ``udfs`` anywhere SQL allows a value, with SQL
    arguments (``calibrate(value) * 1.8 + 32``, ``spike(value - 2) AND unit = 'C'``); each
    call is run once on sample rows here (``rules.calls`` finds and rewrites them).

    Raises:
        ConfigError: ``field`` is ``derive.<name>`` or ``where`` (``functions.<name>`` for a
            UDF failing on sample rows: ``function_failed``); ``reason`` one of
            ``RULE_REASONS``.
    """
    pairs = tuple(derive.items()) if isinstance(derive, Mapping) else derive
    if where is None and not pairs:
        return None
    stage = _Compiler(udfs or {}, udafs)
    compiled: list[pl.Expr | _Calling] = []
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
        step, dtype = stage.step(text, field)
        expr = step.expr if isinstance(step, _Calling) else step
        expr = expr.alias(name)
        if name == "value" and not dtype.is_numeric():
            raise _wrong_type(field, text, f"a number for value, not {dtype}")
        if name in FRAME_SCHEMA and name != "value" and dtype != FRAME_SCHEMA[name]:
            expr = expr.cast(FRAME_SCHEMA[name])
            dtype = FRAME_SCHEMA[name]
        if name == "value":
            expr = expr.cast(pl.Float64)
            dtype = pl.Float64()
        stage.schema[name] = dtype
        compiled.append(_Calling(step.calls, expr) if isinstance(step, _Calling) else expr)
    where_step: pl.Expr | _Calling | None = None
    if where is not None:
        where_step, dtype = stage.step(where, "where")
        if dtype != pl.Boolean:
            raise _wrong_type("where", where, f"a condition (true/false), not {dtype}")
    return RowRules(where, pairs, tuple(compiled), where_step)


class _Compiler:
    """Compiles the row stage's expressions in order, keeping the schema they see.

    ``schema`` gains each derived column and each hidden UDF column; ``sample`` is rows of
    it on which every UDF call runs once (its arguments evaluated by polars).
    """

    def __init__(self, udfs: Mapping[str, Udf], udafs: Collection[str]) -> None:
        self.udfs = udfs
        self.udafs = udafs
        self.schema: dict[str, pl.DataType] = dict(FRAME_SCHEMA)
        self._hidden = 0

    def step(self, text: str, field: str) -> tuple[pl.Expr | _Calling, pl.DataType]:
        """``text`` compiled and checked; its output type."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(
                f"{field}: expected a SQL expression (a non-empty string)",
                field=field,
                reason="bad_expression",
            )
        rewritten = rewrite(text, field, self.udfs, self.udafs, self._hidden)
        aggregate = across_rows(text)
        if aggregate is not None:
            raise _not_per_row(field, text, aggregate)
        self._hidden += len(rewritten.calls)
        if rewritten.calls:
            self._run_calls(rewritten, text, field)
        expr = _compile(rewritten.sql, field, text)
        dtype = _check(expr, text, field, pl.Schema(self.schema))
        return (_Calling(rewritten.calls, expr) if rewritten.calls else expr), dtype

    def _run_calls(self, rewritten: Rewritten, text: str, field: str) -> None:
        """Check each call's arguments, run it on sample rows; its column joins the schema."""
        sample = _sample(pl.Schema(self.schema), SAMPLE_ROWS)
        for call in rewritten.calls:
            for arg in call.args:
                if arg.meta.root_names():  # a literal is spread to the batch: nothing to check
                    _check(arg, text, field, pl.Schema(self.schema))
            try:
                result = call.evaluate(sample)
            except FunctionError as exc:
                raise ConfigError(
                    f"{field}: {text!r}: function {call.udf.spec.name!r} failed on sample "
                    f"data: {exc}",
                    field=f"functions.{call.udf.spec.name}",
                    reason="function_failed",
                ) from exc
            self.schema[call.column] = result.dtype
            sample = sample.with_columns(result)


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


def _compile(text: str, field: str, written: str | None = None) -> pl.Expr:
    """``text`` as a polars expression; ``written``: what the user wrote (if rewritten)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"{field}: expected a SQL expression (a non-empty string)",
            field=field,
            reason="bad_expression",
        )
    try:
        return pl.sql_expr(text)
    except Exception as exc:  # polars raises several SQL error types: wrap them all
        reason, problem = _parse_problem(exc)
        raise ConfigError(
            f"{field}: cannot parse {written or text!r}: {problem}",
            field=field,
            reason=reason,
        ) from exc


def _parse_problem(exc: Exception) -> tuple[str, str]:
    """(reason, what) of polars refusing an expression's text: an unknown function named."""
    line = _first_line(exc)
    match = _UNKNOWN_FUNCTION.search(line)
    if match is None:
        return "bad_expression", line
    return "unknown_function", (
        f"unknown function {match.group(1)}(): not polars SQL, and derive and where call "
        f"only the pipeline's UDFs (a [functions.{match.group(1).lower()}] table) ({line})"
    )


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


def _not_per_row(field: str, text: str, where: str = "an aggregate or OVER") -> ConfigError:
    return ConfigError(
        f"{field}: {text!r} looks across rows ({where}); rules are per row, "
        "since a batch is an arbitrary cut of the data (use aggregates and having for that)",
        field=field,
        reason="not_per_row",
    )
