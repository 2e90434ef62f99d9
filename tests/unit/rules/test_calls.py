"""UDFs inside SQL expressions (``rules.calls``), and UDAF calls under a budget in a combiner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import tomli_w

from shoal.clock import FakeClock
from shoal.control.canonical import SpecRefusal, canonicalize_toml
from shoal.errors import ConfigError, FunctionError
from shoal.processors.spec import parse_pipeline
from shoal.rules import compile_row_rules
from shoal.rules.calls import is_hidden, rewrite
from shoal.rules.functions import FunctionSpec, Udf, load_functions
from shoal.rules.guard import CallGuard
from shoal.schemas import FRAME_SCHEMA
from tests.support.datasets import make_batches
from tests.support.in_memory import run_in_memory

DOUBLE = "def double(x):\n    return x * 2\n"
SCALE = "def scale(x, factor):\n    return x * factor\n"
IS_C = "def is_c(unit):\n    return unit == 'C'\n"


def udfs(**codes: str) -> dict[str, Udf]:
    returns = {"is_c": "bool"}
    specs = tuple(
        FunctionSpec(name, "udf", code, name, returns.get(name, "float"))
        for name, code in codes.items()
    )
    return load_functions(specs).udfs


def frame(values: list[float], units: list[str | None]) -> pl.DataFrame:
    n = len(values)
    return pl.DataFrame(
        {
            "sensor_id": [f"s{i % 2}" for i in range(n)],
            "ts": list(range(n)),
            "value": values,
            "name": [None] * n,
            "type": [None] * n,
            "unit": units,
        },
        schema=FRAME_SCHEMA,
    )


def test_a_udf_inside_sql_gives_what_the_same_sql_gives_on_its_results() -> None:
    rules = compile_row_rules(
        "double(value) > 30 AND unit = 'C'",
        {"f": "double(value) * 1.8 + 32"},
        udfs(double=DOUBLE),
    )
    assert rules is not None
    assert rules.calls_functions
    rows = frame([10.0, 16.0, 20.0, 40.0], ["C", "C", "F", None])
    kept = rules.apply(rows)
    want = rows.with_columns(f=pl.col("value") * 2 * 1.8 + 32).filter(
        ((pl.col("value") * 2 > 30) & (pl.col("unit") == "C")).fill_null(value=False)
    )
    assert kept.frame.equals(want)
    assert kept.filtered == 3
    assert not any(is_hidden(c) for c in kept.frame.columns)


def test_nested_and_repeated_calls_are_computed_inner_first_and_once() -> None:
    functions = udfs(double=DOUBLE)
    rewritten = rewrite("double(double(value)) + double(value)", "derive.x", functions, (), 0)
    assert [c.column for c in rewritten.calls] == ["__SHOAL_UDF_0", "__SHOAL_UDF_1"]
    assert rewritten.calls[0].text.lower() == "double(value)"
    assert '"__SHOAL_UDF_0"' in rewritten.calls[1].text  # the outer call reads the inner one
    assert "double" not in rewritten.sql.lower()
    rules = compile_row_rules(None, {"x": "double(double(value)) + double(value)"}, functions)
    assert rules is not None
    assert rules.apply(frame([1.0, 2.5], ["C", "C"])).frame["x"].to_list() == [6.0, 15.0]


def test_arguments_are_sql_and_literals_are_spread_to_the_batch() -> None:
    rules = compile_row_rules(
        "is_c(unit) OR value < 0",
        {"value": "scale(value - 1, 3)", "name": "CASE WHEN is_c(unit) THEN 'c' END"},
        udfs(scale=SCALE, is_c=IS_C),
    )
    assert rules is not None
    kept = rules.apply(frame([1.0, 2.0, 0.0], ["C", "F", "F"]))
    assert kept.frame["value"].to_list() == [0.0, -3.0]
    assert kept.frame["name"].to_list() == ["c", None]
    assert rules.inputs == {"value", "unit"}


def test_an_expression_without_calls_is_given_to_polars_as_written() -> None:
    text = "value BETWEEN 1 AND 2 AND unit = 'C'"
    assert rewrite(text, "where", udfs(double=DOUBLE), (), 0).sql == text
    assert rewrite("doubled > 1", "where", udfs(double=DOUBLE), (), 0).calls == ()
    plain = compile_row_rules(text, {"x": "value * 2"}, udfs(double=DOUBLE))
    assert plain is not None
    assert not plain.calls_functions  # the one-select plan of a stage without UDFs


UDAF = """
class Total:
    state = {"s": "float"}
    def init(self):
        return {"s": 0.0}
    def update(self, rows):
        return rows.group_by("group").agg(s=pl.col("value").sum())
    def merge(self, states):
        return states.group_by("group").agg(s=pl.col("s").sum())
    def finalize(self, states):
        return states["s"]
"""


def spec_with(**rest: Any) -> dict[str, Any]:
    return {
        "name": "p",
        "windows": [{"size_ms": 1_000}],
        "limits": {"max_future_ms": False},
        "functions": {
            "double": {"code": DOUBLE},
            "abs": {"code": "def abs(x):\n    return x.abs()\n"},
            "total": {"kind": "udaf", "code": UDAF, "entry": "Total"},
        },
        **rest,
    }


@pytest.mark.parametrize(
    ("rules", "field", "reason", "words"),
    [
        ({"where": "nope(value) > 1"}, "where", "unknown_function", "nope"),
        ({"derive": {"x": "sum(double(value))"}}, "derive.x", "not_per_row", "SUM"),
        ({"derive": {"x": "double(value) + 1"}, "where": "x > avg(x)"}, "where", "not_per_row", ""),
        ({"derive": {"x": "double()"}}, "derive.x", "wrong_arity", "without arguments"),
        ({"derive": {"x": "double(value, ts) * 2"}}, "derive.x", "wrong_arity", "2 argument"),
        ({"where": "total(value) > 1"}, "where", "unknown_function", "UDAF"),
        ({"derive": {"x": "abs(value) + 1"}}, "derive.x", "shadowed_function", "rename"),
        ({"derive": {"x": "double(nope) + 1"}}, "derive.x", "unknown_column", "nope"),
        ({"derive": {"x": "double(sum(value)) + 1"}}, "derive.x", "not_per_row", ""),
        ({"where": "double(value) + 1"}, "where", "wrong_type", "condition"),
    ],
)
def test_refusals_name_the_field_and_the_expression(
    rules: dict[str, Any], field: str, reason: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pipeline(spec_with(**rules))
    assert (info.value.field, info.value.reason) == (field, reason)
    assert words in str(info.value)
    text = rules.get("where") if field == "where" else rules["derive"]["x"]
    assert repr(text) in str(info.value)


def test_the_control_plane_refuses_them_as_invalid_expression() -> None:
    refusal = canonicalize_toml(tomli_w.dumps(spec_with(derive={"x": "double()"})))
    assert isinstance(refusal, SpecRefusal)
    assert (refusal.reason, refusal.field) == ("invalid_expression", "derive.x")


def test_a_udf_failing_inside_sql_fails_the_batch() -> None:
    code = (
        "def double(x):\n    if len(x) > 64:\n        raise ValueError('big')\n    return x * 2\n"
    )
    rules = compile_row_rules("double(value) > 1 AND unit = 'C'", {}, udfs(double=code))
    assert rules is not None
    with pytest.raises(FunctionError) as info:
        rules.apply(frame([1.0] * 100, ["C"] * 100))
    assert info.value.reason == "function_error"
    assert "ValueError: big" in str(info.value)


def test_a_udf_failing_on_sample_rows_is_refused_at_deploy() -> None:
    code = "def double(x):\n    raise ValueError('never')\n"
    with pytest.raises(ConfigError) as info:
        compile_row_rules("double(value) > 1", {}, udfs(double=code))
    assert (info.value.field, info.value.reason) == ("functions.double", "function_failed")


# -- a combiner's UDAF calls under a budget ---------------------------------------------------


def test_the_call_guard_bounds_a_call_then_fails_fast_while_it_is_stuck() -> None:
    clock = FakeClock()
    guard = CallGuard(0.05, degrade_after=2, monotonic=clock.monotonic, probe_s=5)
    assert guard.call(lambda: 1) == 1
    began = time.monotonic()
    with pytest.raises(FunctionError) as info:
        guard.call(lambda: time.sleep(0.5))
    assert info.value.reason == "function_timeout"
    assert time.monotonic() - began < 0.4
    began = time.monotonic()
    with pytest.raises(FunctionError) as info:
        guard.call(lambda: 2)
    assert info.value.reason == "function_stuck"
    assert guard.degraded
    with pytest.raises(FunctionError) as info:
        guard.call(lambda: 2)
    assert info.value.reason == "function_degraded"  # resting: not even looked at
    assert time.monotonic() - began < 0.04
    assert {e.reason: n for e, n in guard.take_failures()} == {
        "function_timeout": 1,
        "function_stuck": 1,
        "function_degraded": 1,
    }
    assert guard.take_failures() == []
    time.sleep(0.5)
    clock.advance(5_000)
    assert guard.call(lambda: 3) == 3  # the probe: the stuck call returned, healed
    assert not guard.degraded


HANGING = UDAF.replace(
    "    def merge(self, states):\n",
    "    def merge(self, states):\n        if states.height > 20:\n"
    "            import time\n            time.sleep(3)\n",
)


def test_a_hanging_merge_in_a_combiner_costs_one_budget_and_nulls_its_results() -> None:
    spec = parse_pipeline(
        {
            "name": "p",
            "windows": [{"size_ms": 1_000}],
            "limits": {"max_future_ms": False},
            "lateness_ms": 1_000,
            "idle_timeout_ms": 1_500,
            "aggregates": ["count", "total"],
            "functions": {
                "total": {"kind": "udaf", "code": HANGING, "entry": "Total", "budget_ms": 50}
            },
        }
    )
    began = time.monotonic()
    emitted, _late, combiners = run_in_memory(
        spec, make_batches(seed=4, batches_per_gateway=30), seed=4, workers=3
    )
    assert time.monotonic() - began < 2.5  # not one 3 s sleep waited for
    assert emitted.height > 0
    assert emitted["count"].null_count() == 0  # the built-in aggregates are whole
    assert emitted["total"].null_count() > 0
    guard = combiners[0].functions
    assert guard is not None
    failures = guard.health.as_dict(spec.degrade_after)["failures"]
    assert failures["function_timeout"] >= 1
    assert failures.get("function_stuck", 0) + failures.get("function_degraded", 0) >= 1


POOLED_FINALIZE = UDAF.replace(
    '        return states["s"]',
    '        return states.with_row_index("i").group_by("i", maintain_order=True).agg(\n'
    '            pl.col("s").sum()\n'
    '        )["s"]',
)


def test_a_finalize_that_needs_polars_threads_runs_with_a_pool_of_one(tmp_path: Path) -> None:
    """A guarded ``finalize`` runs outside polars' evaluation of the result columns: waited for
    on a polars thread, a finalize using polars' pool (a group_by) waited for a free pool
    thread until its budget, and with one thread (a one-core device) every result was null."""
    assert POOLED_FINALIZE != UDAF
    script = tmp_path / "pool_of_one.py"
    script.write_text(
        "import polars as pl\n"
        "from shoal.processors.spec import parse_pipeline\n"
        "from tests.support.datasets import make_batches\n"
        "from tests.support.in_memory import run_in_memory\n"
        "assert pl.thread_pool_size() == 1\n"
        f"CODE = {POOLED_FINALIZE!r}\n"
        "spec = parse_pipeline({'name': 'p', 'windows': [{'size_ms': 1000}],\n"
        "    'limits': {'max_future_ms': False}, 'aggregates': ['count', 'total'],\n"
        "    'functions': {'total': {'kind': 'udaf', 'code': CODE, 'entry': 'Total',\n"
        "                            'budget_ms': 2000}}})\n"
        "emitted, _, combiners = run_in_memory(spec, make_batches(seed=4, batches_per_gateway=6),\n"
        "                                      seed=4, workers=2)\n"
        "assert emitted.height > 0\n"
        "assert emitted['total'].null_count() == 0, emitted['total'].null_count()\n"
        "assert combiners[0].functions.health.failures == {}\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "POLARS_MAX_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=root,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
