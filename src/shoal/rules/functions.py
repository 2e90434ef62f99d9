"""Python user functions deployed with a pipeline: vectorised UDFs and mergeable UDAFs.

A spec's ``[functions.<name>]`` tables carry Python source (``code``; a spec file may name a
``file`` instead, which ``load_pipeline`` and ``shoal pipeline deploy`` inline, so the code
travels inside the versioned document). Each is compiled here, once, and checked on sample
data before the spec is accepted; a failure refuses the spec with ``ConfigError(field=
"functions.<name>", reason="function_failed")`` and a traceback summary.

- A **UDF** (``kind = "udf"``) is a function ``(*polars.Series) -> polars.Series`` of the
  same length, called once per batch. ``derive`` and ``where`` call it anywhere in their SQL,
  with SQL arguments: ``f = "fahrenheit(value) + 1"``, ``where = "spike(value * 2) AND
  unit = 'C'"`` (``rules.calls`` finds the calls with a SQL parser and computes them).
- A **UDAF** (``kind = "udaf"``) is a class with the shape every built-in aggregate has
  (``processors/aggregates.py``): ``state`` (field name → ``"int"``/``"float"``), ``init()``
  (the state of no rows), ``update(rows)`` (rows ``group, ts, value`` → one state row per
  group), ``merge(states)`` (state rows ``group, <fields>`` → one per group) and
  ``finalize(states)`` (merged state → one float per row). Its state fields travel in
  partials and checkpoints like built-in ones, so it is exact across workers by construction;
  the deploy check runs ``merge(update(a), update(b)) == update(a + b)`` and
  ``merge(init, x) == x`` on sample data and refuses a function that breaks them.

Every call to user code goes through ``_calling``, which turns whatever it raises, and any
result of the wrong length or type, into ``FunctionError`` (an ``InputError``: the worker
dead-letters the batch and counts it). Budgets and isolation are ``shoal.rules.guard``'s.
Imports ``shoal.errors`` and ``shoal.schemas`` only.
"""

from __future__ import annotations

import hashlib
import re
import threading
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import ConfigError, FunctionError

T = TypeVar("T")

FunctionKind = Literal["udf", "udaf"]
FUNCTION_KINDS: Final = ("udf", "udaf")
RETURN_TYPES: Final[dict[str, pl.DataType]] = {
    "float": pl.Float64(),
    "int": pl.Int64(),
    "bool": pl.Boolean(),
    "string": pl.String(),
}
"""What a UDF may declare it returns (``returns``), and the polars type it is cast to."""
STATE_KINDS: Final[dict[str, pl.DataType]] = {"int": pl.Int64(), "float": pl.Float64()}
DEFAULT_BUDGET_MS: Final = 200
"""A function's default per-batch time budget."""
MAX_BUDGET_MS: Final = 60_000
FUNCTION_REASONS: Final = frozenset(
    {
        "function_error",
        "function_bad_result",
        "function_timeout",
        "function_stuck",
        "function_degraded",
    }
)
"""Dead-letter reasons of a batch a function failed on (``FunctionError.reason``)."""
SAMPLE_ROWS: Final = 64
"""Rows of the sample data functions run on at deploy time."""

_NAME: Final = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
_TRACE_FRAMES: Final = 3


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One ``[functions.<name>]`` table: the source and how it is called.

    Attributes:
        name: what ``derive``/``where``/``aggregates`` call it.
        kind: ``udf`` or ``udaf``.
        code: Python source defining it.
        entry: the name the code binds it to (default: ``name``).
        returns: a UDF's result type (``RETURN_TYPES``); ``float`` for a UDAF.
        budget_ms: its share of a batch's time budget in the worker.
    """

    name: str
    kind: FunctionKind
    code: str
    entry: str
    returns: str = "float"
    budget_ms: int = DEFAULT_BUDGET_MS

    @property
    def code_hash(self) -> str:
        """A short hash of the source (part of the partials' fingerprint)."""
        return hashlib.sha256(self.code.encode()).hexdigest()[:12]


def parse_function(name: str, table: Mapping[str, Any]) -> FunctionSpec:
    """Check one ``[functions.<name>]`` table's settings (the code is compiled later).

    Raises:
        ConfigError: ``field`` ``functions.<name>[.<key>]``, reason ``invalid_spec``.
    """
    where = f"functions.{name}"
    if not _NAME.match(name):
        raise ConfigError(f"{where}: not a function name ([a-z_][a-z0-9_]*)", field=where)
    known = {"kind", "code", "entry", "returns", "budget_ms", "file"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown settings {unknown}", field=f"{where}.{unknown[0]}")
    kind = table.get("kind", "udf")
    if kind not in FUNCTION_KINDS:
        raise ConfigError(f"{where}.kind: {kind!r} is not udf or udaf", field=f"{where}.kind")
    code = table.get("code")
    if "file" in table and code is None:
        raise ConfigError(
            f"{where}.file: {table['file']!r} was not inlined (a spec read from a file or sent "
            "with `shoal pipeline deploy` carries the file's code; a spec mapping must carry "
            "`code`)",
            field=f"{where}.file",
        )
    if not isinstance(code, str) or not code.strip():
        raise ConfigError(f"{where}.code: expected Python source", field=f"{where}.code")
    entry = table.get("entry", name)
    if not isinstance(entry, str) or not entry.isidentifier():
        raise ConfigError(f"{where}.entry: not a Python name", field=f"{where}.entry")
    returns = table.get("returns", "float")
    if returns not in RETURN_TYPES or (kind == "udaf" and returns != "float"):
        allowed = "float" if kind == "udaf" else ", ".join(RETURN_TYPES)
        raise ConfigError(f"{where}.returns: {returns!r}; use {allowed}", field=f"{where}.returns")
    budget = table.get("budget_ms", DEFAULT_BUDGET_MS)
    if type(budget) is not int or not 1 <= budget <= MAX_BUDGET_MS:
        raise ConfigError(
            f"{where}.budget_ms: {budget!r}; an integer in [1, {MAX_BUDGET_MS}]",
            field=f"{where}.budget_ms",
        )
    return FunctionSpec(name, kind, code, entry, returns, budget)


# -- calling user code -----------------------------------------------------------------------


def traceback_summary(exc: BaseException, filename: str) -> str:
    """The exception and the last frames of user code (``filename``) it passed through."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    where = "; ".join(f"line {f.lineno} in {f.name}" for f in frames[-_TRACE_FRAMES:])
    head = f"{type(exc).__name__}: {exc}".strip()
    return f"{head} ({where})" if where else head


@contextmanager
def _calling(spec: FunctionSpec, step: str) -> Iterator[None]:
    """Whatever user code raises becomes ``FunctionError(function_error)`` naming the step."""
    try:
        yield
    except FunctionError:
        raise
    except Exception as exc:  # user code may raise anything: that is the point
        raise FunctionError(
            f"function {spec.name!r} ({step}) raised {traceback_summary(exc, _filename(spec))}",
            reason="function_error",
            field=f"functions.{spec.name}",
        ) from exc


def _bad_result(spec: FunctionSpec, step: str, expected: str, found: str) -> FunctionError:
    return FunctionError(
        f"function {spec.name!r} ({step}) returned the wrong thing",
        reason="function_bad_result",
        field=f"functions.{spec.name}",
        expected=expected,
        found=found,
    )


def _filename(spec: FunctionSpec) -> str:
    return f"<function {spec.name}>"


def _load(spec: FunctionSpec) -> Any:
    """Execute the source in a fresh module; the object bound to ``entry``."""
    module = types.ModuleType(f"shoal_user_{spec.name}")
    module.__dict__["pl"] = pl
    module.__dict__["np"] = np
    compiled = compile(spec.code, _filename(spec), "exec")
    exec(compiled, module.__dict__)  # noqa: S102 - deploying code is the feature (admin only)
    if spec.entry not in module.__dict__:
        raise NameError(f"the code defines no {spec.entry!r}")
    return module.__dict__[spec.entry]


_GUARDED = threading.local()


@contextmanager
def guarded() -> Iterator[None]:
    """Mark this thread's calls as a worker's guarded batch (``rules.guard``).

    There every failure, a UDAF ``merge`` included, fails the batch rather than be absorbed.
    """
    _GUARDED.on = True
    try:
        yield
    finally:
        _GUARDED.on = False


def in_guarded_batch() -> bool:
    """Whether this thread runs a worker's guarded batch (``guarded``)."""
    return bool(getattr(_GUARDED, "on", False))


# -- UDF ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Udf:
    """A loaded UDF."""

    spec: FunctionSpec
    fn: Callable[..., Any] = field(compare=False, repr=False)

    @property
    def dtype(self) -> pl.DataType:
        """The polars type of its result."""
        return RETURN_TYPES[self.spec.returns]

    def __call__(self, args: list[pl.Series]) -> pl.Series:
        """Call it on a batch's columns; the result checked for length and type.

        Raises:
            FunctionError: it raised (``function_error``) or returned something else than a
                series of the batch's length convertible to its type (``function_bad_result``).
        """
        height = args[0].len() if args else 0
        with _calling(self.spec, "udf"):
            out = self.fn(*args)
        if isinstance(out, np.ndarray):
            out = pl.Series(self.spec.name, out)
        if not isinstance(out, pl.Series):
            raise _bad_result(self.spec, "udf", "a polars Series", type(out).__name__)
        if out.len() != height:
            raise _bad_result(self.spec, "udf", f"{height} values", f"{out.len()}")
        return _cast(out, self.dtype, self.spec, "udf").alias(self.spec.name)


def _cast(series: pl.Series, dtype: pl.DataType, spec: FunctionSpec, step: str) -> pl.Series:
    """``series`` as ``dtype``: numbers among numbers, else exactly ``dtype``."""
    if series.dtype == dtype:
        return series
    if dtype.is_numeric() and (series.dtype.is_numeric() or series.dtype == pl.Null):
        return series.cast(dtype)
    if series.dtype == pl.Null:
        return series.cast(dtype)
    raise _bad_result(spec, step, str(dtype), str(series.dtype))


# -- UDAF ------------------------------------------------------------------------------------


class Budget(Protocol):
    """Runs a call within a time budget (``rules.guard.CallGuard``)."""

    def call(self, work: Callable[[], T], budget_s: float | None = None) -> T:
        """``work()`` within ``budget_s``, or a ``FunctionError`` saying why not."""
        ...


class Udaf:
    """A loaded UDAF: the user object and vectorised calls that check what it returns.

    ``partial``/``merge`` take the sorted runs of groups that the aggregate kernels see
    (``_kernels.Runs``: ``starts``, ``lengths`` and columns) and return every state field
    at once; the per-field kernels of ``processors.aggregates.user_aggregate`` read them
    from a per-thread memo, so the user function runs once per batch, not once per field.
    """

    def __init__(self, spec: FunctionSpec, obj: Any) -> None:
        self.spec = spec
        self.obj = obj
        state = getattr(obj, "state", None)
        if not isinstance(state, Mapping) or not state:
            raise TypeError("a UDAF declares `state`: a dict of field name -> 'int' or 'float'")
        for name, kind in state.items():
            if not isinstance(name, str) or not _NAME.match(name) or kind not in STATE_KINDS:
                raise TypeError(f"state field {name!r}: {kind!r} (want a name -> int/float)")
        self.state: dict[str, str] = dict(state)
        for method in ("init", "update", "merge", "finalize"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(f"a UDAF has a method {method}()")
        self._memo = threading.local()
        self.budget: Budget | None = None
        """Where ``merge`` and ``finalize`` run outside a worker's guarded batch (set by the
        combiner: ``processors.user_aggregates.budget_user_aggregates``; None: directly)."""

    @property
    def schema(self) -> pl.Schema:
        """Its state columns and their types."""
        return pl.Schema({n: STATE_KINDS[k] for n, k in self.state.items()})

    def column(self, field_name: str) -> str:
        """The state column of ``field_name`` in partials and merged state."""
        return f"{self.spec.name}__{field_name}"

    def init(self) -> pl.DataFrame:
        """The state of no rows, one row."""
        with _calling(self.spec, "init"):
            out = self.obj.init()
        if not isinstance(out, Mapping):
            raise _bad_result(self.spec, "init", "a dict of state fields", type(out).__name__)
        frame = pl.DataFrame({n: [out.get(n)] for n in self.state})
        return self._state_frame(frame, 1, "init", grouped=False)

    def update(self, groups: npt.NDArray[np.int64], ts: Any, value: Any, n: int) -> pl.DataFrame:
        """State of each of ``n`` groups (ids 0..n-1 in ``groups``) from their rows."""
        rows = pl.DataFrame(
            {"group": groups, "ts": ts, "value": value},
            schema={"group": pl.Int64, "ts": pl.Int64, "value": pl.Float64},
        )
        with _calling(self.spec, "update"):
            out = self.obj.update(rows)
        return self._state_frame(out, n, "update")

    def merge(self, states: pl.DataFrame, n: int) -> pl.DataFrame:
        """One state row per group of ``states`` (``group`` ids 0..n-1)."""
        out = self._budgeted("merge", lambda: self.obj.merge(states))
        return self._state_frame(out, n, "merge")

    def finalize(self, states: pl.DataFrame) -> pl.Series:
        """The result per state row, Float64."""
        fields = states.select(list(self.state))
        out = self._budgeted("finalize", lambda: self.obj.finalize(fields))
        if isinstance(out, np.ndarray):
            out = pl.Series(self.spec.name, out)
        if not isinstance(out, pl.Series):
            raise _bad_result(self.spec, "finalize", "a polars Series", type(out).__name__)
        if out.len() != states.height:
            raise _bad_result(self.spec, "finalize", f"{states.height} values", f"{out.len()}")
        return _cast(out, pl.Float64(), self.spec, "finalize").alias(self.spec.name)

    def _budgeted(self, step: str, work: Callable[[], Any]) -> Any:
        """``work`` (a call of user code) under ``budget`` unless in a worker's guarded batch.

        In a worker's batch the whole batch already runs under the pipeline's guard.
        """

        def run() -> Any:
            with _calling(self.spec, step):
                return work()

        if self.budget is None or in_guarded_batch():
            return run()
        return self.budget.call(run, self.spec.budget_ms / 1000.0)

    def _state_frame(self, out: Any, n: int, step: str, *, grouped: bool = True) -> pl.DataFrame:
        """``out`` checked: a frame of one row per group 0..n-1, sorted, typed state columns."""
        if not isinstance(out, pl.DataFrame):
            raise _bad_result(self.spec, step, "a polars DataFrame", type(out).__name__)
        wanted = ["group", *self.state] if grouped else list(self.state)
        missing = [c for c in wanted if c not in out.columns]
        if missing:
            raise _bad_result(self.spec, step, f"columns {wanted}", f"{out.columns}")
        if out.height != n:
            raise _bad_result(self.spec, step, f"{n} rows (one per group)", f"{out.height}")
        if grouped:
            out = out.sort("group")
            ids = out.get_column("group").cast(pl.Int64, strict=False).to_numpy()
            if not np.array_equal(ids, np.arange(n)):
                raise _bad_result(self.spec, step, f"groups 0..{n - 1} once each", "others")
        return pl.DataFrame(
            [
                _cast(out.get_column(c), STATE_KINDS[k], self.spec, step)
                for c, k in self.state.items()
            ]
        )

    # -- the kernels' side (``processors.aggregates.user_aggregate``) -----------------------

    def fields_of(self, runs: Any, *, merging: bool) -> dict[str, npt.NDArray[Any]]:
        """Every state field of the groups of ``runs`` (memoised per runs object)."""
        memo = getattr(self._memo, "value", None)
        if memo is not None and memo[0] is runs:
            result: dict[str, npt.NDArray[Any]] = memo[1]
            return result
        n = len(runs.starts)
        groups = np.repeat(np.arange(n, dtype=np.int64), runs.lengths)
        if merging:
            states = pl.DataFrame(
                {
                    "group": groups,
                    **{f: runs.columns[self.column(f)] for f in self.state},
                },
                schema={"group": pl.Int64, **self.schema},
            )
            frame = self.merge(states, n)
        else:
            frame = self.update(groups, runs.columns["ts"], runs.columns["value"], n)
        fields = {self.column(f): frame.get_column(f).to_numpy() for f in self.state}
        self._memo.value = (runs, fields)
        return fields

    def forget(self) -> None:
        """Drop the memo (the last field of a pass read it)."""
        self._memo.value = None


# -- compiling and checking at deploy ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Functions:
    """A pipeline's functions, loaded and checked."""

    specs: tuple[FunctionSpec, ...] = ()
    udfs: dict[str, Udf] = field(default_factory=dict, compare=False, repr=False)
    udafs: dict[str, Udaf] = field(default_factory=dict, compare=False, repr=False)

    @property
    def budget_ms(self) -> int:
        """The per-batch budget of a pipeline with these functions (the sum of theirs)."""
        return sum(s.budget_ms for s in self.specs)

    def __bool__(self) -> bool:
        return bool(self.specs)


def load_functions(specs: tuple[FunctionSpec, ...]) -> Functions:
    """Import each function and run it once on sample data.

    Raises:
        ConfigError: ``field`` ``functions.<name>``, ``reason`` ``function_failed``, the
            message a traceback summary.
    """
    udfs: dict[str, Udf] = {}
    udafs: dict[str, Udaf] = {}
    for spec in specs:
        try:
            obj = _load(spec)
        except Exception as exc:  # a SyntaxError, an ImportError, anything at import
            raise _refused(spec, "import", exc) from exc
        if spec.kind == "udf":
            if not callable(obj):
                raise _refused(spec, "import", TypeError(f"{spec.entry} is not callable"))
            udfs[spec.name] = Udf(spec, obj)
            continue
        try:
            instance = obj() if isinstance(obj, type) else obj
            udaf = Udaf(spec, instance)
            check_udaf(udaf)
        except Exception as exc:  # every refusal names the function and what failed
            raise _refused(spec, "sample data", exc) from exc
        udafs[spec.name] = udaf
    return Functions(specs, udfs, udafs)


def check_udaf(udaf: Udaf) -> None:
    """``update``, ``merge``, ``init`` and ``finalize`` on sample data, and mergeability.

    The sample: groups of different sizes, one of them one row. Checked: the state of all
    rows equals the merge of the states of two halves (any cut of a group into batches must
    give the same state), and merging the ``init`` state changes nothing.

    Raises:
        FunctionError: a call failed, returned the wrong shape, or broke a law.
    """
    rng = np.random.default_rng(16)
    groups = np.sort(rng.integers(0, 4, SAMPLE_ROWS)).astype(np.int64)
    groups[-1] = 4  # a group of one row
    ts = np.sort(rng.integers(1_700_000_000_000, 1_700_000_060_000, SAMPLE_ROWS)).astype(np.int64)
    value = np.round(rng.normal(20.0, 5.0, SAMPLE_ROWS), 3)
    n = int(groups.max()) + 1
    whole = udaf.update(groups, ts, value, n)
    cut = np.arange(SAMPLE_ROWS) % 2 == 0
    halves = []
    for part in (cut, ~cut):
        present, local = np.unique(groups[part], return_inverse=True)
        state = udaf.update(local.astype(np.int64), ts[part], value[part], len(present))
        halves.append(state.with_columns(pl.Series("group", present)))
    stacked = pl.concat(halves, how="vertical_relaxed")
    merged = udaf.merge(stacked.select("group", *udaf.state), n)
    _same(udaf, whole, merged, "merge(update(a), update(b)) differs from update(a + b)")
    identity = udaf.init()
    with_init = pl.concat(
        [
            whole.with_columns(pl.Series("group", np.arange(n))),
            pl.concat([identity] * n).with_columns(pl.Series("group", np.arange(n))),
        ],
        how="vertical_relaxed",
    )
    _same(udaf, whole, udaf.merge(with_init.select("group", *udaf.state), n), "merge(init, x) != x")
    udaf.finalize(merged)


def _same(udaf: Udaf, a: pl.DataFrame, b: pl.DataFrame, law: str) -> None:
    for name in udaf.state:
        x, y = a.get_column(name).to_numpy(), b.get_column(name).to_numpy()
        if not np.allclose(x, y, rtol=1e-9, atol=1e-12, equal_nan=True):
            raise FunctionError(
                f"function {udaf.spec.name!r} is not mergeable: {law} in state field {name!r}",
                reason="function_bad_result",
                field=f"functions.{udaf.spec.name}",
            )


def _refused(spec: FunctionSpec, step: str, exc: BaseException) -> ConfigError:
    text = str(exc) if isinstance(exc, FunctionError) else traceback_summary(exc, _filename(spec))
    return ConfigError(
        f"functions.{spec.name}: refused at {step}: {text}",
        field=f"functions.{spec.name}",
        reason="function_failed",
    )
