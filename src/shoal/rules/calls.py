"""UDF calls inside SQL expressions: found with sqlglot, computed as hidden columns.

Polars' SQL (``pl.sql_expr``) cannot call Python, so a ``derive``/``where`` expression that
calls a pipeline's UDFs (``calibrate(value) * 1.8 + 32``) is parsed with sqlglot, a real SQL
parser: every call of a declared UDF, innermost first, becomes a hidden column
(``__SHOAL_UDF_<n>``, upper case: no derived column can be named so) whose value the UDF
computes from its arguments, each an SQL expression polars evaluates on the batch; the
expression is then written back as SQL naming those columns, for polars to evaluate. An
expression without such a call is left exactly as written (polars reads its text).

Refused here, naming the field and the expression (``ConfigError``): a UDF name that SQL
already has as a function (``log``: which one would run?), a UDAF called on rows, a call
with a number of arguments the function does not take, a call inside an aggregate or
``OVER`` (a batch is an arbitrary cut of the data). Types, columns and the sample-data run
are ``rules.expressions``'. Imports ``shoal.errors`` and ``rules.functions`` only.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import polars as pl

from shoal.errors import ConfigError
from shoal.rules.functions import Udf

if TYPE_CHECKING:
    from sqlglot import exp

HIDDEN_PREFIX: Final = "__SHOAL_UDF_"
"""Hidden columns holding UDF results; dropped after the row stage."""


@dataclass(frozen=True, slots=True)
class Call:
    """One UDF call of an expression.

    Attributes:
        column: the hidden column it fills.
        udf: the function.
        text: the call as SQL (hidden columns standing for the calls inside it).
        args: its arguments, as polars expressions over the batch (and earlier hidden columns).
    """

    column: str
    udf: Udf
    text: str
    args: tuple[pl.Expr, ...]

    def evaluate(self, frame: pl.DataFrame) -> pl.Series:
        """The UDF on its arguments evaluated over ``frame`` (literals spread to its height).

        Raises:
            FunctionError: the UDF failed (``Udf.__call__``).
        """
        computed = {  # a column argument is taken as it is (the common case: no query)
            f"__SHOAL_ARG_{i}": arg for i, arg in enumerate(self.args) if not arg.meta.is_column()
        }
        if computed:
            frame = frame.with_columns(arg.alias(name) for name, arg in computed.items())
        series = [
            frame.get_column(arg.meta.output_name() if arg.meta.is_column() else f"__SHOAL_ARG_{i}")
            for i, arg in enumerate(self.args)
        ]
        return self.udf(series).alias(self.column)


@dataclass(frozen=True, slots=True)
class Rewritten:
    """An expression with its UDF calls replaced by hidden columns.

    Attributes:
        sql: what polars evaluates: the text as written when it calls no UDF.
        calls: the calls, each after the calls inside its arguments.
    """

    sql: str
    calls: tuple[Call, ...] = ()


def hidden_column(index: int) -> str:
    """The hidden column of a row stage's ``index``-th UDF call."""
    return f"{HIDDEN_PREFIX}{index}"


def is_hidden(column: str) -> bool:
    """Whether ``column`` is a hidden UDF column."""
    return column.startswith(HIDDEN_PREFIX)


def _parsed(text: str) -> exp.Expr | None:
    """The parse tree of ``text`` (sqlglot), None if it cannot parse it.

    sqlglot is imported here, on the first expression parsed: it holds ~16 MB in a process,
    and most workers and every combiner of a pipeline without rules never parse one.
    """
    import sqlglot  # noqa: PLC0415
    from sqlglot.errors import SqlglotError  # noqa: PLC0415

    try:
        return sqlglot.parse_one(text)
    except SqlglotError:
        return None


def rewrite(
    text: str, field: str, udfs: Mapping[str, Udf], udafs: Collection[str], first: int
) -> Rewritten:
    """``text`` with each call of a UDF in ``udfs`` replaced; hidden columns from ``first``.

    SQL sqlglot cannot parse is left to polars (which then parses it or says why not).

    Raises:
        ConfigError: ``field``; reasons ``shadowed_function``, ``unknown_function``,
            ``wrong_arity``, ``not_per_row`` or ``bad_expression``.
    """
    names = set(udfs) | set(udafs)
    if not names or not any(name in text.lower() for name in names):
        return Rewritten(text)
    tree = _parsed(text)
    if tree is None:
        return Rewritten(text)
    from sqlglot import exp  # noqa: PLC0415 - loaded by _parsed

    found = [
        node for node in tree.find_all(exp.Func) if _check_call(node, text, field, udfs, udafs)
    ]
    if not found:
        return Rewritten(text)
    calls: list[Call] = []
    seen: dict[str, str] = {}  # a call's SQL -> its hidden column: the same call computed once
    for node in reversed(found):  # descendants before ancestors: inner calls first
        assert isinstance(node, exp.Anonymous)
        call_sql = node.sql()
        column = seen.get(call_sql)
        if column is None:
            column = hidden_column(first + len(calls))
            seen[call_sql] = column
            args = tuple(_argument(arg, call_sql, text, field) for arg in node.expressions)
            calls.append(Call(column, udfs[node.name.lower()], call_sql, args))
        replacement = exp.column(column, quoted=True)
        if node is tree:
            tree = replacement
        else:
            node.replace(replacement)
    return Rewritten(tree.sql(), tuple(calls))


def across_rows(text: str) -> str | None:
    """The first aggregate or ``OVER`` in ``text`` (as SQL), or None.

    Polars spreads an aggregate compared with a column (``value > avg(value)``) to every
    row, so running the expression on sample rows cannot see it; its parse tree can.
    """
    tree = _parsed(text)
    if tree is None:
        return None
    from sqlglot import exp  # noqa: PLC0415 - loaded by _parsed

    found = tree.find(exp.AggFunc, exp.Window)
    return None if found is None else found.sql()


def _check_call(
    node: exp.Func, text: str, field: str, udfs: Mapping[str, Udf], udafs: Collection[str]
) -> bool:
    """Whether ``node`` calls a UDF (checked: arity, not inside an aggregate or OVER)."""
    from sqlglot import exp  # noqa: PLC0415 - a node's module, loaded with it

    if not isinstance(node, exp.Anonymous):
        shadowed = sorted({n.lower() for n in type(node).sql_names()} & (set(udfs) | set(udafs)))
        if shadowed:
            raise ConfigError(
                f"{field}: {text!r}: {shadowed[0]!r} is also an SQL function, so it cannot "
                f"be told from [functions.{shadowed[0]}]; rename the function",
                field=field,
                reason="shadowed_function",
            )
        return False
    name = node.name.lower()
    if name in udafs:
        raise ConfigError(
            f"{field}: {text!r} calls {name}(), a UDAF: it aggregates windows, name it in "
            "`aggregates` (derive and where call UDFs, kind = 'udf')",
            field=field,
            reason="unknown_function",
        )
    if name not in udfs:
        return False  # a function only polars knows: it says so if it does not
    _check_arity(udfs[name], len(node.expressions), text, field)
    outer = node.find_ancestor(exp.AggFunc, exp.Window)
    if outer is not None:
        raise ConfigError(
            f"{field}: {text!r} calls {name}() inside {outer.sql()!r}: rules are per row, "
            "since a batch is an arbitrary cut of the data (use aggregates, or a UDAF, for that)",
            field=field,
            reason="not_per_row",
        )
    return True


def _check_arity(udf: Udf, count: int, text: str, field: str) -> None:
    name = udf.spec.name
    if count == 0:
        raise ConfigError(
            f"{field}: {text!r} calls {name}() without arguments; a UDF gets at least one "
            "column (its result has one value per row)",
            field=field,
            reason="wrong_arity",
        )
    try:
        signature = inspect.signature(udf.fn)
    except (TypeError, ValueError):  # a callable without a signature: the sample run decides
        return
    try:
        signature.bind(*range(count))
    except TypeError as exc:
        raise ConfigError(
            f"{field}: {text!r} calls {name}() with {count} argument(s), but "
            f"{udf.spec.entry}{signature} {exc}",
            field=field,
            reason="wrong_arity",
        ) from exc


def _argument(arg: exp.Expression, call: str, text: str, field: str) -> pl.Expr:
    sql = arg.sql()
    try:
        return pl.sql_expr(sql)
    except Exception as exc:  # polars raises several SQL error types: wrap them all
        lines = str(exc).strip().splitlines()
        raise ConfigError(
            f"{field}: {text!r}: argument {sql!r} of {call}: "
            f"{lines[0] if lines else type(exc).__name__}",
            field=field,
            reason="bad_expression",
        ) from exc
