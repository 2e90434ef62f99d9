"""User functions: deploy-time checks and refusals, the row stage and UDAF state, the guard."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from shoal.clock import FakeClock
from shoal.control.canonical import SpecRefusal, canonical_mapping, canonicalize_toml
from shoal.errors import ConfigError, FunctionError
from shoal.processors.partials import BatchInfo, PartialBuilder, spec_fingerprint
from shoal.processors.spec import load_pipeline, parse_pipeline
from shoal.processors.user_aggregates import ERRORS
from shoal.rules.functions import guarded
from shoal.rules.guard import FunctionGuard
from tests.support.datasets import make_batches
from tests.support.in_memory import check_against_oracle, run_in_memory

EXAMPLES = Path(__file__).resolve().parents[3] / "processors" / "examples"

SCALE = """
def scale(value):
    return value * 2
"""
SUMS = """
class Sums:
    state = {"n": "int", "s": "float"}
    def init(self):
        return {"n": 0, "s": 0.0}
    def update(self, rows):
        return rows.group_by("group").agg(n=pl.len().cast(pl.Int64), s=pl.col("value").sum())
    def merge(self, states):
        return states.group_by("group").agg(n=pl.col("n").sum(), s=pl.col("s").sum())
    def finalize(self, states):
        return states["s"] / states["n"]
"""


def spec_with(functions: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {
        "name": "p",
        "windows": [{"size_ms": 1_000}],
        "limits": {"max_future_ms": False},
        "functions": functions,
        **rest,
    }


def refusal(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_pipeline(raw)
    return info.value


def test_a_udf_in_derive_and_a_udaf_parse() -> None:
    spec = parse_pipeline(
        spec_with(
            {"scale": {"code": SCALE}, "mymean": {"kind": "udaf", "code": SUMS, "entry": "Sums"}},
            derive={"value": "scale(value)"},
            aggregates=["count", "mymean"],
        )
    )
    assert spec.calls_functions
    assert spec.plan().field_names[-2:] == ("mymean__n", "mymean__s")


@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("def scale(value):\n    return value *\n", "SyntaxError"),
        ("import no_such_module\ndef scale(v):\n    return v\n", "No module named"),
        ("def other(value):\n    return value\n", "defines no 'scale'"),
        ("def scale(value):\n    return value.head(1)\n", "wrong thing"),
        ("def scale(value):\n    return 1 / 0\n", "ZeroDivisionError"),
        ("def scale(value):\n    return 'text'\n", "polars Series"),
    ],
)
def test_a_udf_that_fails_at_deploy_is_refused_with_the_traceback(code: str, words: str) -> None:
    exc = refusal(spec_with({"scale": {"code": code}}, derive={"x": "scale(value)"}))
    assert exc.reason == "function_failed"
    assert exc.field == "functions.scale"
    assert words in str(exc)


def test_the_traceback_summary_names_the_line_of_user_code() -> None:
    code = (
        "def helper(v):\n    raise ValueError('bad calibration')\n\n"
        "def scale(value):\n    return helper(value)\n"
    )
    exc = refusal(spec_with({"scale": {"code": code}}, derive={"x": "scale(value)"}))
    assert "ValueError: bad calibration" in str(exc)
    assert "line 2 in helper" in str(exc)
    assert "line 5 in scale" in str(exc)


def test_a_udf_on_an_unknown_column_is_refused() -> None:
    exc = refusal(spec_with({"scale": {"code": SCALE}}, derive={"x": "scale(nope)"}))
    assert exc.reason == "unknown_column"
    assert exc.field == "derive.x"


def test_where_needs_a_bool_udf() -> None:
    exc = refusal(spec_with({"scale": {"code": SCALE}}, where="scale(value)"))
    assert exc.field == "where"
    assert exc.reason == "wrong_type"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (('return states["s"] / states["n"]', "return 1 / 0"), "ZeroDivisionError"),
        (('n=pl.col("n").sum()', 'n=pl.col("n").max()'), "not mergeable"),
        (('"n": 0, "s": 0.0', '"n": 1, "s": 0.0'), "merge(init, x) != x"),
        (('state = {"n": "int", "s": "float"}', 'state = {"n": "text"}'), "state field"),
        (("def init(self):", "def start(self):"), "has a method init"),
    ],
)
def test_a_udaf_that_fails_its_laws_at_deploy_is_refused(
    change: tuple[str, str], words: str
) -> None:
    code = SUMS.replace(*change)
    assert code != SUMS
    raw = spec_with(
        {"mymean": {"kind": "udaf", "code": code, "entry": "Sums"}}, aggregates=["mymean"]
    )
    exc = refusal(raw)
    assert exc.reason == "function_failed"
    assert exc.field == "functions.mymean"
    assert words in str(exc)


def test_a_refused_function_is_function_failed_to_the_control_plane() -> None:
    text = (
        'name = "p"\nderive.x = "scale(value)"\n[[windows]]\nsize_ms = 1000\n'
        '[functions.scale]\ncode = "def scale(v):\\n    raise KeyError(1)\\n"\n'
    )
    refused = canonicalize_toml(text)
    assert isinstance(refused, SpecRefusal)
    assert (refused.reason, refused.field) == ("function_failed", "functions.scale")


def test_functions_travel_in_the_canonical_form_and_the_fingerprint() -> None:
    spec = load_pipeline(EXAMPLES / "udaf-ewm.toml")
    mapping = canonical_mapping(spec)
    assert "class Ewm" in mapping["functions"]["ewm"]["code"]
    assert "file" not in mapping["functions"]["ewm"]
    again = parse_pipeline(mapping)
    assert again == dataclasses.replace(spec, source=None)
    edited = {**mapping, "functions": {"ewm": {**mapping["functions"]["ewm"]}}}
    edited["functions"]["ewm"]["code"] += "\n# a comment changes the code\n"
    assert spec_fingerprint(parse_pipeline(edited)) != spec_fingerprint(spec)


def test_a_udaf_matches_its_plain_polars_oracle_with_many_workers() -> None:
    """The ewm example, 3 workers and 2 partitions, shuffled and duplicated deliveries."""
    spec = load_pipeline(EXAMPLES / "udaf-ewm.toml")
    spec = parse_pipeline(
        {
            **canonical_mapping(spec),
            "partitions": 2,
            "windows": [{"kind": "hopping", "size_ms": 4_000, "slide_ms": 2_000}],
            "limits": {"max_future_ms": False},
        }
    )
    batches = make_batches(seed=11, batches_per_gateway=30)
    combiners = check_against_oracle(spec, batches, seed=11, workers=3)
    assert sum(c.counters.results_emitted for c in combiners) > 0


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            "    if len(value) > 64:\n        raise RuntimeError('boom')\n    return value",
            "function_error",
        ),
        ("    return value.head(3) if len(value) > 64 else value", "function_bad_result"),
        ("    return value.cast(pl.String) if len(value) > 64 else value", "function_bad_result"),
    ],
)
def test_a_failing_udf_raises_function_error_on_a_batch(body: str, reason: str) -> None:
    code = f"def scale(value):\n{body}\n"
    spec = parse_pipeline(spec_with({"scale": {"code": code}}, derive={"value": "scale(value)"}))
    builder = PartialBuilder(spec, "w")
    frame = pl.concat([b.frame for b in make_batches(seed=3, batches_per_gateway=40)])
    assert frame.height > 64  # bigger than the deploy-time sample, which passes
    info = BatchInfo("gw0", 0, "s", 0, None, None, 0, 0, "w")
    with pytest.raises(FunctionError) as info_:
        builder.build(frame, info, 0)
    assert info_.value.reason == reason


# -- the guard --------------------------------------------------------------------------------


def _run(guard: FunctionGuard, work: Any) -> Any:
    return asyncio.run(guard.run(work))


def test_the_guard_returns_results_and_counts_failures_until_degraded() -> None:
    guard = FunctionGuard(budget_s=1.0, degrade_after=2, monotonic=time.monotonic)
    assert _run(guard, lambda: 7) == 7

    def boom() -> None:
        raise FunctionError("x", reason="function_error")

    for _ in range(2):
        with pytest.raises(FunctionError):
            _run(guard, boom)
    assert guard.degraded
    assert guard.health.as_dict(2)["failures"] == {"function_error": 2}
    assert _run(guard, lambda: 1) == 1
    assert not guard.degraded
    assert guard.health.batches_ok == 2


def test_a_bug_surfacing_in_shoal_code_is_a_function_error() -> None:
    guard = FunctionGuard(budget_s=1.0, degrade_after=3, monotonic=time.monotonic)
    with pytest.raises(FunctionError) as info:
        _run(guard, lambda: {}["missing"])
    assert info.value.reason == "function_error"


def test_a_python_loop_past_its_budget_is_interrupted() -> None:
    guard = FunctionGuard(budget_s=0.05, degrade_after=3, monotonic=time.monotonic)
    stop_at = time.monotonic() + 30

    def spin() -> int:
        while time.monotonic() < stop_at:
            pass
        return 0

    began = time.monotonic()
    with pytest.raises(FunctionError) as info:
        _run(guard, spin)
    assert info.value.reason == "function_timeout"
    assert time.monotonic() - began < 5
    # The interrupt stopped the loop within the grace: the next call runs at once.
    assert _run(guard, lambda: 3) == 3


def test_a_call_blocked_in_c_makes_later_batches_fail_at_once_until_it_returns() -> None:
    guard = FunctionGuard(budget_s=0.05, degrade_after=3, monotonic=time.monotonic)
    with pytest.raises(FunctionError) as info:
        _run(guard, lambda: time.sleep(0.6))
    assert info.value.reason == "function_timeout"
    began = time.monotonic()
    with pytest.raises(FunctionError) as info:
        _run(guard, lambda: 1)
    assert info.value.reason == "function_stuck"
    assert time.monotonic() - began < 0.04  # no wait: refused at once
    time.sleep(0.7)
    assert _run(guard, lambda: 2) == 2


# -- a UDAF's merge failing at run time -------------------------------------------------------

FRAGILE = SUMS.replace(
    "    def merge(self, states):\n",
    "    def merge(self, states):\n        if states.height > 20:\n"
    "            raise OverflowError('too many states')\n",
)


def test_a_failing_merge_fails_the_batch_in_a_worker() -> None:
    """Hopping windows merge panes in the worker: under the guard that fails the batch."""
    spec = parse_pipeline(
        spec_with(
            {"mymean": {"kind": "udaf", "code": FRAGILE, "entry": "Sums"}},
            aggregates=["count", "mymean"],
            windows=[{"kind": "hopping", "size_ms": 4_000, "slide_ms": 1_000}],
        )
    )
    frame = pl.concat([b.frame for b in make_batches(seed=3, batches_per_gateway=40)])
    info = BatchInfo("gw0", 0, "s", 0, None, None, 0, 0, "w")
    with pytest.raises(FunctionError) as raised, guarded():
        PartialBuilder(spec, "w").build(frame, info, 0)
    assert raised.value.reason == "function_error"
    assert "OverflowError: too many states" in str(raised.value)


def test_a_failing_merge_in_a_combiner_nulls_its_results_and_is_counted() -> None:
    spec = parse_pipeline(
        spec_with(
            {"mymean": {"kind": "udaf", "code": FRAGILE, "entry": "Sums"}},
            aggregates=["count", "mymean"],
            lateness_ms=1_000,
            idle_timeout_ms=1_500,
        )
    )
    before = ERRORS["mymean"]
    emitted, _late, _combiners = run_in_memory(
        spec, make_batches(seed=4, batches_per_gateway=30), seed=4, workers=3
    )
    assert ERRORS["mymean"] > before
    assert emitted.height > 0
    assert emitted["count"].null_count() == 0  # the other aggregates are whole
    assert emitted["mymean"].null_count() > 0


def test_a_pipeline_degraded_by_time_fails_fast_until_a_probe() -> None:
    """After degrade_after batches past the budget, batches fail at once (no budget waited:
    the worker's other pipelines are not held back) until the probe interval passed."""
    clock = FakeClock()
    guard = FunctionGuard(budget_s=0.02, degrade_after=2, monotonic=clock.monotonic, probe_s=5)
    stop_at = time.monotonic() + 30

    def spin() -> None:
        while time.monotonic() < stop_at:
            pass

    for _ in range(2):
        with pytest.raises(FunctionError, match="budget"):
            _run(guard, spin)
    began = time.monotonic()
    for _ in range(5):
        with pytest.raises(FunctionError) as raised:
            _run(guard, spin)
        assert raised.value.reason == "function_degraded"
    assert time.monotonic() - began < 0.02 * 5  # none waited out a budget
    clock.advance(5_000)
    assert _run(guard, lambda: 1) == 1  # the probe runs, and heals it
    assert not guard.degraded
    assert guard.health.failures == {"function_timeout": 2, "function_degraded": 5}


def test_a_udaf_in_a_session_window_is_refused() -> None:
    exc = refusal(
        spec_with(
            {"mymean": {"kind": "udaf", "code": SUMS, "entry": "Sums"}},
            aggregates=["mymean"],
            windows=[{"kind": "session", "gap_ms": 1_000}],
        )
    )
    assert exc.field == "aggregates"
    assert "session" in str(exc)


def test_shoal_pipeline_deploy_ships_a_referenced_file_inside_the_spec() -> None:
    from shoal._cli.pipeline import _read_spec  # noqa: PLC0415 - what `deploy FILE` sends

    text = _read_spec(str(EXAMPLES / "udaf-ewm.toml"))
    canonical = canonicalize_toml(text)
    assert not isinstance(canonical, SpecRefusal)
    assert "class Ewm" in canonical.mapping["functions"]["ewm"]["code"]
    plain = (EXAMPLES / "filter-derive.toml").read_text()
    assert _read_spec(str(EXAMPLES / "filter-derive.toml")) == plain  # no file: as it was


def test_a_missing_function_file_is_refused_naming_it(tmp_path: Path) -> None:
    spec = tmp_path / "p.toml"
    spec.write_text(
        'name = "p"\naggregates = ["f"]\n[[windows]]\nsize_ms = 1000\n'
        '[functions.f]\nkind = "udaf"\nfile = "nowhere.py"\n'
    )
    with pytest.raises(ConfigError) as raised:
        load_pipeline(spec)
    assert raised.value.field == "functions.f.file"
