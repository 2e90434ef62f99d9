"""Pipeline specs: ``processors/*.toml`` parsed once into frozen, validated config objects.

A spec says what to read (topic filters), how to key and window it, which aggregates to
compute, how late data may be, and how results leave. ``PipelineSpec`` objects are the only
configuration the processing code sees; nothing below reads files or the environment.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import polars as pl

from shoal.errors import ConfigError, UsageError
from shoal.processors.aggregates import AGGREGATES, ALIASES, QUANTILES, AggregatePlan, AggregateSpec
from shoal.processors.sessions import SESSION_KIND
from shoal.processors.user_aggregates import user_aggregate
from shoal.processors.windows import WINDOW_KINDS, WindowSpec
from shoal.rules import AlertSpec, Having, RowRules, compile_having, compile_row_rules
from shoal.rules.alerts import MAX_FOR
from shoal.rules.functions import Functions, FunctionSpec, load_functions, parse_function
from shoal.schemas import ATTRIBUTE_COLUMNS, FUTURE_POLICIES, DecodeLimits
from shoal.schemas.topics import check_segment

OutputEncoding = Literal["json", "msgpack"]

KEY_COLUMNS: Final = ("sensor_id", *ATTRIBUTE_COLUMNS)
MAX_WINDOWS_PER_ROW: Final = 64
"""A hopping window puts each row into size/slide windows; beyond this the spec is refused."""
STEPS_PER_WINDOW: Final = 10
"""A sliding window's default ``step_ms`` is ``size_ms`` / this (when it divides)."""
ALERT_WINDOW_KINDS: Final = ("tumbling", "hopping")
"""Window kinds alerts may watch: aligned windows, which close in start order."""
DEFAULT_DEGRADE_AFTER: Final = 3
"""Consecutive failed batches after which a pipeline with functions is ``degraded``."""
UDAF_WINDOW_KINDS: Final = ("tumbling", "hopping", "sliding")
"""Window kinds a user aggregate may run in (their state is per-batch partials)."""
MAX_COUNT_ROWS: Final = 1_000_000
"""Largest ``n`` of a count window: a combiner keeps up to ``n - 1`` rows per key and window."""
DEFAULT_MAX_STATE_CELLS: Final = 4_000_000
"""Cap on a combiner partition's open state cells when its spec sets none and the memory it
may use is not known (``PipelineSpec.state_cap``)."""
STATE_CELL_BYTES: Final = 300
"""What a state cell costs a combiner, at the upper end of what was measured (docs/benchmarks.md
"Memory per key and open window": 180-290 bytes; ~300 during the chaos runs)."""
STATE_MEMORY_SHARE: Final = 0.25
"""Share of the memory a combiner may use that its default state cap is sized to (the rest:
the process itself, transient merge and result frames, buffers; docs/guarantees.md)."""
MIN_DEFAULT_STATE_CELLS: Final = 100_000
"""Smallest default state cap (~30 MB of state), however little memory there is."""


def default_state_cells(memory_bytes: int | None) -> int:
    """The state cap of a spec that sets none, for a process that may use ``memory_bytes``.

    A quarter of that memory at ``STATE_CELL_BYTES`` a cell, so that the cap, not the kernel's
    out-of-memory killer, is what stops a runaway state, on a small gateway as on a large
    host. None (memory not known): ``DEFAULT_MAX_STATE_CELLS``.
    """
    if memory_bytes is None:
        return DEFAULT_MAX_STATE_CELLS
    return max(MIN_DEFAULT_STATE_CELLS, int(memory_bytes * STATE_MEMORY_SHARE) // STATE_CELL_BYTES)


def default_max_hold_ms(lateness_ms: int, idle_timeout_ms: int) -> int:
    """The bounded hold a pipeline gets unless its spec says otherwise.

    Twice the time a healthy gateway may legitimately be behind (its lateness plus a pause up
    to the idle timeout): a gateway that merely pauses is never released, one that is
    broken delays the others by at most this.
    """
    return 2 * (lateness_ms + idle_timeout_ms)


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """A pipeline: one processor group (workers + combiners) and its results.

    Attributes:
        name: the pipeline (shared-subscription group, topic segment, result label).
        inputs: topic filters below the topic root, e.g. ``ingest/+/+``.
        key: column results are grouped by (``sensor_id`` or an attribute).
        windows: one or more windows computed side by side.
        aggregates: requested aggregates, in output order.
        lateness_ms: how long after a window's end data may still arrive (per gateway).
        allowed_lateness_ms: how much later still a row folds into its window after it
            closed, published as a correction (a higher ``revision``); 0: never, later rows
            only go to the late topic (docs/guarantees.md "Late corrections").
        idle_timeout_ms: a gateway silent this long stops holding the watermark back.
        max_hold_ms: the longest one gateway may keep windows open that every other gateway
            has finished (a clock far behind, input all refused, a gateway gone quiet with
            batches announced); then its later rows for closed windows are late. Default
            (None, or 0 in TOML): ``2 * (lateness_ms + idle_timeout_ms)``; see
            ``hold_bound_ms``.
        partitions: combiner partitions (keys are spread over them by a stable hash).
        output_encodings: encodings of the per-window result message (first = main topic).
        key_results_every_ms: publish a time window's retained per-key results only for the
            first window ending at or after each multiple of this (``key_results_due``); 0
            (the default): every window. Window messages go out for every window either way.
        sketch_accuracy: relative error bound of quantile estimates.
        checkpoint_interval_ms: how often combiners persist state and confirm.
        limits: decode limits applied by workers.
        max_state_cells: the most state cells (merged (window, key) rows and quantile-sketch
            buckets) one combiner partition holds open; a partial that could grow it beyond
            is refused and dead-lettered (``StateCapError``, docs/guarantees.md
            "Bounded memory"). Set in ``[limits]``; None (not set): sized from the memory
            the combiner may use (``state_cap``, ``default_state_cells``).
        source: the file the spec came from, if any.
        where: row condition (SQL, ``shoal.rules``); rows it rejects are counted, not kept.
        derive: (column, SQL expression) computed on each batch before ``where``.
        having: condition over a window result row; failing rows are withheld (counted).
        row_rules: ``where`` and ``derive`` compiled (None: no row stage).
        having_rule: ``having`` compiled (None: every result row is published).
        alerts: ``[[alerts]]``, compiled (``shoal.rules.alerts``).
        functions: ``[functions.<name>]``: Python UDFs and UDAFs (``shoal.rules.functions``).
        loaded: the functions, imported and checked on sample data.
        degrade_after: consecutive batches a function fails on before the pipeline is
            reported ``degraded`` (worker heartbeats, ``shoal status``, ``pipeline list``).
    """

    name: str
    inputs: tuple[str, ...]
    key: str
    windows: tuple[WindowSpec, ...]
    aggregates: tuple[AggregateSpec, ...]
    lateness_ms: int = 2_000
    allowed_lateness_ms: int = 0
    idle_timeout_ms: int = 10_000
    max_hold_ms: int | None = None
    partitions: int = 1
    output_encodings: tuple[OutputEncoding, ...] = ("json",)
    key_results_every_ms: int = 0
    sketch_accuracy: float = 0.01
    checkpoint_interval_ms: int = 1_000
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    max_state_cells: int | None = None
    source: Path | None = None
    where: str | None = None
    derive: tuple[tuple[str, str], ...] = ()
    having: str | None = None
    row_rules: RowRules | None = field(default=None, compare=False, repr=False)
    having_rule: Having | None = field(default=None, compare=False, repr=False)
    alerts: tuple[AlertSpec, ...] = ()
    functions: tuple[FunctionSpec, ...] = ()
    loaded: Functions = field(default_factory=Functions, compare=False, repr=False)
    degrade_after: int = DEFAULT_DEGRADE_AFTER

    @property
    def calls_functions(self) -> bool:
        """Whether the worker runs user code on this pipeline's batches (under a budget)."""
        return bool(self.loaded.udafs) or (
            self.row_rules is not None and self.row_rules.calls_functions
        )

    @property
    def reads_attributes(self) -> bool:
        """Whether the pipeline reads a row's attributes (its key, or a row-stage input).

        The bench and ``shoal up`` give such a pipeline gateways that send them.
        """
        if self.key in ATTRIBUTE_COLUMNS:
            return True
        return self.row_rules is not None and bool(self.row_rules.inputs & set(ATTRIBUTE_COLUMNS))

    @property
    def hold_bound_ms(self) -> int:
        """``max_hold_ms``, or its default derived from the lateness and the idle timeout."""
        if self.max_hold_ms is not None:
            return self.max_hold_ms
        return default_max_hold_ms(self.lateness_ms, self.idle_timeout_ms)

    def key_results_due(self, window: str, end: int) -> bool:
        """Whether the retained per-key results of ``window``'s window ending at ``end`` go out.

        With ``key_results_every_ms`` (E): a time window's when it is the first of its
        window to end at or after a multiple of E (one lies in ``(end - slide, end]``), so a
        sliding window stepping 1 s with E = 10 s refreshes each key's retained result every
        10 s, decided by event time alone (the same after any restart). Session and count
        windows end off any grid: always, as without E.
        """
        every = self.key_results_every_ms
        spec = next((w for w in self.windows if w.name == window), None)
        if not every or spec is None or spec.gap_ms is not None or spec.by_count:
            return True
        return end // every > (end - spec.slide_ms) // every

    def state_cap(self, memory_bytes: int | None) -> int:
        """``max_state_cells``, or the default for a combiner that may use ``memory_bytes``."""
        if self.max_state_cells is not None:
            return self.max_state_cells
        return default_state_cells(memory_bytes)

    @property
    def needs_last_ts(self) -> bool:
        """Whether a window kind reads each state's latest event time (``WindowKind.emitted``)."""
        return any(  # (session windows are no entry of WINDOW_KINDS)
            w.kind in WINDOW_KINDS and WINDOW_KINDS[w.kind].needs_last_ts for w in self.windows
        )

    def plan(self) -> AggregatePlan:
        """The state this spec's partials carry: its aggregates' and its window kinds' needs."""
        return AggregatePlan.for_aggregates(self.aggregates, last_ts=self.needs_last_ts)

    @property
    def aggregate_names(self) -> tuple[str, ...]:
        """Output names of the aggregates, in order."""
        return tuple(a.name for a in self.aggregates)

    @property
    def quantiles(self) -> tuple[float, ...]:
        """Requested quantiles in (0, 1), in order."""
        return tuple(a.quantile for a in self.aggregates if a.quantile is not None)

    def window(self, name: str) -> WindowSpec:
        """The window called ``name``."""
        for window in self.windows:
            if window.name == name:
                return window
        raise UsageError(
            f"{self.name}: no window named {name!r}; the windows are "
            f"{[w.name for w in self.windows]}"
        )


# --------------------------------------------------------------------------------------------
# Parsing


def load_pipeline(path: Path) -> PipelineSpec:
    """Read and validate a pipeline spec file.

    Raises:
        ConfigError: unreadable TOML or an invalid spec; the message names file and field.
    """
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read pipeline spec: {exc}") from exc
    return parse_pipeline(inline_function_files(raw, path.parent), source=path)


def inline_function_files(raw: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """``raw`` with each ``[functions.<name>] file = "x.py"`` read into its ``code``.

    Paths are relative to ``folder`` (the spec file's). The code then travels inside the
    spec: the control plane stores and versions it with the rest of the document.

    Raises:
        ConfigError: a file cannot be read (``field`` ``functions.<name>.file``).
    """
    functions = raw.get("functions")
    if not isinstance(functions, Mapping):
        return dict(raw)
    inlined: dict[str, Any] = {}
    for name, table in functions.items():
        if isinstance(table, Mapping) and isinstance(table.get("file"), str):
            file = folder / table["file"]
            try:
                code = file.read_text("utf-8")
            except OSError as exc:
                raise ConfigError(
                    f"functions.{name}.file: cannot read {file}: {exc}",
                    field=f"functions.{name}.file",
                ) from exc
            inlined[name] = {k: v for k, v in table.items() if k != "file"} | {"code": code}
        else:
            inlined[name] = table
    return {**raw, "functions": inlined}


def parse_pipeline(raw: Mapping[str, Any], *, source: Path | None = None) -> PipelineSpec:
    """Validate a spec given as a mapping (the parsed TOML)."""
    where = str(source) if source else "pipeline spec"
    reader = _Reader(raw, where)
    name = reader.name("name")
    inputs = reader.strings("inputs", default=("ingest/+/+",))
    for topic_filter in inputs:
        if not _is_filter(topic_filter):
            raise reader.error(
                "inputs", f"inputs: {topic_filter!r} is not a valid MQTT topic filter"
            )
    key = reader.choice("key", KEY_COLUMNS, default="sensor_id")
    windows = tuple(
        _window(_Reader(w, f"{where}: windows[{i}]", f"windows[{i}]"))
        for i, w in enumerate(reader.tables("windows"))
    )
    if not windows:
        raise reader.error("windows", "at least one [[windows]] table is required")
    if len({w.name for w in windows}) != len(windows):
        raise reader.error("windows", f"window names must be unique: {[w.name for w in windows]}")
    _check_count_windows(windows, reader)
    functions = _functions(reader)
    aggregates = tuple(
        _aggregate(a, reader, functions)
        for a in reader.strings("aggregates", default=("count", "mean", "min", "max"))
    )
    if any(a.user is not None for a in aggregates):
        odd = [w.kind for w in windows if w.kind not in UDAF_WINDOW_KINDS]
        if odd:
            raise reader.error(
                "aggregates",
                f"user aggregates run in {', '.join(UDAF_WINDOW_KINDS)} windows, not {odd[0]}",
            )
    if len({a.name for a in aggregates}) != len(aggregates):
        raise reader.error(
            "aggregates", f"an aggregate is listed twice: {[a.name for a in aggregates]}"
        )
    encodings = reader.strings("output_encodings", default=("json",))
    for enc in encodings:
        if enc not in ("json", "msgpack"):
            raise reader.error(
                "output_encodings", f"output_encodings: {enc!r} is not json or msgpack"
            )
    sketch = _Reader(reader.table("sketch"), f"{where}: [sketch]", "sketch")
    accuracy = sketch.number("relative_accuracy", default=0.01, low=1e-4, high=0.2)
    sketch.finish()
    limits_reader = _Reader(reader.table("limits"), f"{where}: [limits]", "limits")
    max_state_cells = limits_reader.integer("max_state_cells", default=0, low=1_000, high=2**40)
    limits = _limits(limits_reader)
    rules = _rules(reader, aggregates, functions)
    rules["alerts"] = tuple(
        _alert(_Reader(a, f"{where}: alerts[{i}]", f"alerts[{i}]"), aggregates, windows)
        for i, a in enumerate(reader.tables("alerts"))
    )
    if len({a.name for a in rules["alerts"]}) != len(rules["alerts"]):
        raise reader.error("alerts", "alert names must be unique")
    spec = PipelineSpec(
        name=name,
        inputs=inputs,
        key=key,
        windows=windows,
        aggregates=aggregates,
        lateness_ms=reader.integer("lateness_ms", default=2_000, low=0, high=86_400_000),
        allowed_lateness_ms=reader.integer(
            "allowed_lateness_ms", default=0, low=0, high=86_400_000
        ),
        idle_timeout_ms=reader.integer("idle_timeout_ms", default=10_000, low=100, high=86_400_000),
        max_hold_ms=reader.integer("max_hold_ms", default=0, low=0, high=86_400_000) or None,
        partitions=reader.integer("partitions", default=1, low=1, high=64),
        output_encodings=tuple(encodings),  # type: ignore[arg-type]
        key_results_every_ms=reader.integer(
            "key_results_every_ms", default=0, low=0, high=86_400_000
        ),
        sketch_accuracy=accuracy,
        checkpoint_interval_ms=reader.integer(
            "checkpoint_interval_ms", default=1_000, low=50, high=60_000
        ),
        limits=limits,
        max_state_cells=max_state_cells or None,
        source=source,
        functions=functions.specs,
        loaded=functions,
        degrade_after=reader.integer(
            "degrade_after", default=DEFAULT_DEGRADE_AFTER, low=1, high=1_000_000
        ),
        **rules,
    )
    reader.finish()
    return spec


def _functions(reader: _Reader) -> Functions:
    """``[functions.<name>]`` tables, imported and run on sample data (``rules.functions``)."""
    table = reader.table("functions")
    specs = []
    for name, body in table.items():
        if not isinstance(body, Mapping):
            raise reader.error(f"functions.{name}", f"[functions.{name}] must be a table")
        try:
            specs.append(parse_function(str(name), body))
        except ConfigError as exc:
            raise ConfigError(f"{reader.where}: {exc}", field=exc.field, reason=exc.reason) from exc
    clash = [s.name for s in specs if s.name in AGGREGATES or s.name in ALIASES]
    if clash:
        raise reader.error(f"functions.{clash[0]}", f"{clash[0]!r} is a built-in aggregate")
    try:
        return load_functions(tuple(specs))
    except ConfigError as exc:
        raise ConfigError(f"{reader.where}: {exc}", field=exc.field, reason=exc.reason) from exc


def _rules(
    reader: _Reader, aggregates: tuple[AggregateSpec, ...], functions: Functions
) -> dict[str, Any]:
    """``where``, ``[derive]`` and ``having``, compiled and checked (``shoal.rules``)."""
    where = reader._get("where")
    if where is not None and not isinstance(where, str):
        raise reader.error("where", "where must be a string (a SQL condition)")
    derive_table = reader.table("derive")
    for name, text in derive_table.items():
        if not isinstance(text, str):
            raise reader.error(f"derive.{name}", f"derive.{name} must be a string (SQL)")
    having = reader._get("having")
    if having is not None and not isinstance(having, str):
        raise reader.error("having", "having must be a string (a SQL condition)")
    derive = tuple((str(k), str(v)) for k, v in derive_table.items())
    try:
        row_rules = compile_row_rules(where, derive, functions.udfs, functions.udafs)
        having_rule = (
            None
            if having is None
            else compile_having(having, {a.name: _result_dtype(a) for a in aggregates})
        )
    except ConfigError as exc:
        raise ConfigError(f"{reader.where}: {exc}", field=exc.field, reason=exc.reason) from exc
    return {
        "where": where,
        "derive": derive,
        "having": having,
        "row_rules": row_rules,
        "having_rule": having_rule,
    }


def _alert(
    reader: _Reader, aggregates: tuple[AggregateSpec, ...], windows: tuple[WindowSpec, ...]
) -> AlertSpec:
    """One ``[[alerts]]`` table: name, condition, for, resolve, window."""
    name = reader.name("name")
    texts: dict[str, str | None] = {}
    for key in ("condition", "resolve"):
        value = reader._get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise reader.error(key, f"{key} must be a SQL condition (a non-empty string)")
        texts[key] = value
    condition = texts["condition"]
    if condition is None:
        raise reader.error("condition", "an alert needs a condition (SQL over the aggregates)")
    for_windows = reader.integer("for", default=1, low=1, high=MAX_FOR)
    window = reader.choice("window", tuple(w.name for w in windows), default=windows[0].name)
    kind = next(w for w in windows if w.name == window).kind
    if kind not in ALERT_WINDOW_KINDS:
        # Alerts take a key's results in start order, which for these kinds is close order.
        raise reader.error(
            "window",
            f"alerts watch {' or '.join(ALERT_WINDOW_KINDS)} windows, not {kind} windows (yet)",
        )
    reader.finish()
    try:
        return AlertSpec.build(
            name,
            condition,
            for_windows=for_windows,
            resolve=texts["resolve"],
            window=window,
            columns={a.name: _result_dtype(a) for a in aggregates},
        )
    except ConfigError as exc:
        field = f"{reader.path}.{exc.field}" if exc.field else reader.path
        raise ConfigError(f"{reader.where}: {exc}", field=field, reason=exc.reason) from exc


def _result_dtype(aggregate: AggregateSpec) -> Any:
    """The polars type of an aggregate's result column (quantiles: Float64)."""
    known = aggregate.entry
    return pl.Float64() if known is None else known.dtype


class _Reader:
    """Typed access to one TOML table that remembers which keys were used.

    ``where`` starts every message (``pipeline spec: windows[0]``); ``path`` is the table's
    place in the spec (``windows[0]``, ``limits``; ``""``: the top), which prefixes the
    ``field`` of every error (``windows[0].size_ms``).
    """

    def __init__(self, raw: Mapping[str, Any], where: str, path: str = "") -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a table", field=path or None)
        self.raw = raw
        self.where = where
        self.path = path
        self.used: set[str] = set()

    def error(self, key: str, problem: str, *, reason: str | None = None) -> ConfigError:
        """The error for setting ``key`` of this table: message, field path and reason."""
        field = f"{self.path}.{key}" if self.path else key
        return ConfigError(f"{self.where}: {problem}", field=field, reason=reason)

    def _get(self, key: str) -> Any:
        self.used.add(key)
        return self.raw.get(key)

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            raise self.error(unknown[0], f"unknown setting(s) {unknown}")

    def name(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self.error(key, f"{key} must be a string")
        try:
            return check_segment(value, key)
        except ConfigError as exc:  # TopicError: say which spec and field
            raise self.error(key, str(exc)) from None

    def strings(self, key: str, *, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise self.error(key, f"{key} must be a non-empty list of strings")
        return tuple(value)

    def choice(self, key: str, options: tuple[str, ...], *, default: str) -> str:
        value = self._get(key)
        if value is None:
            return default
        if value not in options:
            raise self.error(key, f"{key} must be one of {list(options)}, not {value!r}")
        return str(value)

    def integer(self, key: str, *, default: int, low: int, high: int) -> int:
        value = self._get(key)
        if value is None:
            return default
        if type(value) is not int or not low <= value <= high:
            raise self.error(key, f"{key} must be an integer in [{low}, {high}], not {value!r}")
        return value

    def number(self, key: str, *, default: float, low: float, high: float) -> float:
        value = self._get(key)
        if value is None:
            return default
        if type(value) not in (int, float) or not low <= value <= high:
            raise self.error(key, f"{key} must be a number in [{low}, {high}], not {value!r}")
        return float(value)

    def table(self, key: str) -> Mapping[str, Any]:
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.error(key, f"[{key}] must be a table")
        return value

    def tables(self, key: str) -> list[Mapping[str, Any]]:
        value = self._get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise self.error(key, f"{key} must be an array of tables ([[{key}]])")
        return value


DEFAULT_MAX_SESSION_MS: Final = 3_600_000
"""A session window's ``max_duration_ms`` unless set: sessions are cut on the hour grid."""


def _check_count_windows(windows: tuple[WindowSpec, ...], reader: _Reader) -> None:
    """Count windows: never beside time windows, never with late corrections.

    Workers ship rows rather than state for count windows, and a late row would shift the
    ranks of every later window of its key: no correction could be exact.
    """
    counted = [w.name for w in windows if w.by_count]
    if not counted:
        return
    if len(counted) != len(windows):
        raise reader.error(
            "windows",
            f"count windows {counted} cannot share a pipeline with time windows; deploy "
            "them as a pipeline of their own over the same inputs",
        )
    if reader.raw.get("allowed_lateness_ms"):
        raise reader.error(
            "allowed_lateness_ms",
            "allowed_lateness_ms must be 0 with count windows: a late row would shift every "
            "later window of its key, so late rows go to the late topic (set lateness_ms to "
            "wait longer before windows close)",
        )


def _count_window(reader: _Reader) -> WindowSpec:
    """``kind = "count"``: ``n`` (or ``count``) rows per key and window."""
    for key in ("size_ms", "slide_ms"):
        if key in reader.raw:
            raise reader.error(key, f"{key} is not for count windows; they take n (rows)")
    if "n" in reader.raw and "count" in reader.raw:
        raise reader.error("count", "give n or count, not both")
    key = "count" if "count" in reader.raw else "n"
    n = reader.integer(key, default=0, low=1, high=MAX_COUNT_ROWS)
    if n == 0:
        raise reader.error("n", "count windows need n, the rows per window and key")
    name = reader.name("name") if "name" in reader.raw else f"count-{n}"
    reader.finish()
    return WindowSpec(name=name, kind="count", size_ms=1, slide_ms=1, count=n)


def _window(reader: _Reader) -> WindowSpec:
    kinds = (*WINDOW_KINDS, SESSION_KIND)
    chosen = reader.choice("kind", kinds, default="tumbling")
    if chosen == SESSION_KIND:
        return _session_window(reader)
    kind = WINDOW_KINDS[chosen]
    if kind.name == "count":
        return _count_window(reader)
    size = reader.integer("size_ms", default=0, low=1, high=31 * 86_400_000)
    if size == 0:
        raise reader.error("size_ms", "size_ms is required")
    for other in {k.slide_key for k in WINDOW_KINDS.values() if k.takes_slide}:
        if other in reader.raw and (not kind.takes_slide or other != kind.slide_key):
            takers = " or ".join(
                k.name for k in WINDOW_KINDS.values() if k.takes_slide and k.slide_key == other
            )
            raise reader.error(other, f"{other} is only for {takers} windows")
    if not kind.takes_slide:
        slide = size
    else:
        key = kind.slide_key
        # A step (sliding) defaults to a tenth of the size: ten windows per row and at most
        # ten results per key and window length, whatever the size; a slide has no default.
        default = (
            size // STEPS_PER_WINDOW if key == "step_ms" and size % STEPS_PER_WINDOW == 0 else 0
        )
        slide = reader.integer(key, default=default, low=1, high=size)
        if slide == 0:
            raise reader.error(key, f"{kind.name} windows need {key}")
        if size % slide:
            raise reader.error("size_ms", f"size_ms ({size}) must be a multiple of {key} ({slide})")
        if size // slide > MAX_WINDOWS_PER_ROW:
            raise reader.error(
                "size_ms",
                f"size_ms/{key} = {size // slide} windows per row; at most "
                f"{MAX_WINDOWS_PER_ROW} are supported",
            )
    default_name = f"{kind.name}-{_duration(size)}" + (
        f"-{_duration(slide)}" if kind.takes_slide else ""
    )
    name = reader.name("name") if "name" in reader.raw else default_name
    reader.finish()
    return WindowSpec(name=name, kind=kind.name, size_ms=size, slide_ms=slide)


def _session_window(reader: _Reader) -> WindowSpec:
    """``kind = "session"``: ``gap_ms`` and ``max_duration_ms`` (docs/guarantees.md).

    Its ``size_ms`` and ``slide_ms`` are the gap: a piece of a session is judged late by the
    window ``[first_ts, first_ts + gap_ms)`` it would open alone.
    """
    for aligned in ("size_ms", "slide_ms"):
        if aligned in reader.raw:
            raise reader.error(aligned, f"{aligned} is not for session windows; set gap_ms")
    gap = reader.integer("gap_ms", default=0, low=1, high=31 * 86_400_000)
    if gap == 0:
        raise reader.error("gap_ms", "session windows need gap_ms")
    longest = reader.integer(
        "max_duration_ms", default=max(DEFAULT_MAX_SESSION_MS, gap), low=gap, high=366 * 86_400_000
    )
    name = reader.name("name") if "name" in reader.raw else f"{SESSION_KIND}-{_duration(gap)}"
    reader.finish()
    return WindowSpec(
        name=name,
        kind=SESSION_KIND,
        size_ms=gap,
        slide_ms=gap,
        gap_ms=gap,
        max_duration_ms=longest,
    )


def _aggregate(text: str, reader: _Reader, functions: Functions) -> AggregateSpec:
    name = text.strip().lower()
    name = ALIASES.get(name, name)
    if name in AGGREGATES:
        return AggregateSpec(name)
    if name in functions.udafs:
        return AggregateSpec(name, user=user_aggregate(functions.udafs[name]))
    q = QUANTILES.parse(name)
    if q is not None:
        return AggregateSpec(name, quantile=q)
    raise reader.error(
        "aggregates",
        f"unknown aggregate {text!r}; use {', '.join(AGGREGATES)}, a quantile "
        "like p50, p95, p99, p99.9, or a UDAF of [functions]",
        reason="unknown_aggregate",
    )


def _limits(reader: _Reader) -> DecodeLimits:
    defaults = DecodeLimits()
    values: dict[str, int | None] = {}
    for name in ("max_payload_bytes", "max_rows", "max_string_bytes", "max_decompressed_bytes"):
        values[name] = reader.integer(name, default=getattr(defaults, name), low=1, high=2**40)
    for name in ("max_future_ms", "max_past_ms"):
        raw_value = reader._get(name)
        if raw_value is None:
            values[name] = getattr(defaults, name)
        elif raw_value is False:
            values[name] = None
        elif type(raw_value) is int and raw_value >= 0:
            values[name] = raw_value
        else:
            raise reader.error(name, f"{name} must be a non-negative integer or false")
    on_future = reader.choice("on_future", FUTURE_POLICIES, default=defaults.on_future)
    if on_future == "clamp" and values["max_future_ms"] is None:
        raise reader.error("on_future", "on_future = 'clamp' needs max_future_ms (not false)")
    reader.finish()
    return DecodeLimits(**values, on_future=on_future)  # type: ignore[arg-type]


def _is_filter(topic_filter: str) -> bool:
    levels = topic_filter.split("/")
    bad = (
        not topic_filter
        or topic_filter.startswith(("/", "$"))
        or any(("+" in lv and lv != "+") or ("#" in lv and lv != "#") for lv in levels)
        or ("#" in levels and levels.index("#") != len(levels) - 1)
    )
    return not bad


def _duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
