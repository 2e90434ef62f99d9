"""``shoal bench pipeline --window``: the variant spec keeps everything but its windows, and
several kinds are compared with the first in one invocation."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal._resources import resource_dir
from shoal.errors import ConfigError
from shoal.loadtest.bench_kinds import compare_kinds, format_comparison, parse_kinds
from shoal.loadtest.bench_windows import SPEC_PRESETS, WINDOW_PRESETS, write_variant
from shoal.processors.spec import load_pipeline


@pytest.mark.parametrize("kind", sorted(WINDOW_PRESETS))
def test_variant_has_one_window_of_the_kind_and_the_rest_unchanged(
    kind: str, tmp_path: Path
) -> None:
    source = resource_dir("processors") / "baseline-equivalent.toml"
    original = load_pipeline(source)

    variant = load_pipeline(write_variant(source, kind, tmp_path))

    assert [w.kind for w in variant.windows] == [kind]
    assert variant.windows[0].name == WINDOW_PRESETS[kind]["name"]
    assert variant.name == original.name
    assert variant.key == original.key
    assert variant.aggregate_names == original.aggregate_names
    assert variant.lateness_ms == original.lateness_ms
    assert variant.limits == original.limits
    # per-key results every 10 s for the kinds whose rows land in ten windows, else as before
    every = SPEC_PRESETS.get(kind, {}).get("key_results_every_ms", 0)
    assert variant.key_results_every_ms == every
    assert every == (10_000 if kind in ("hopping", "sliding") else 0)


def test_unknown_kind_names_the_presets(tmp_path: Path) -> None:
    source = resource_dir("processors") / "default.toml"

    with pytest.raises(ConfigError, match=r"known: .*tumbling") as caught:
        write_variant(source, "spiral", tmp_path)

    assert caught.value.field == "window"


def test_several_kinds_are_compared_round_by_round_with_the_first() -> None:
    """``--window tumbling,sliding --rounds 3``: interleaved runs, ratios per round."""
    figures = iter([100.0, 60.0, 80.0, 44.0, 120.0, 48.0])  # tumbling, sliding per round
    order: list[str] = []

    def run_one(kind: str) -> dict[str, object]:
        order.append(kind)
        steps = [{"lost_measurements": 0, "duplicated_measurements": 0}]
        return {"max_sustained_meas_per_s": next(figures), "steps": steps}

    result = compare_kinds(parse_kinds("tumbling, sliding"), 3, run_one)

    assert order == ["tumbling", "sliding"] * 3
    sliding = result["summary"]["sliding"]
    assert sliding["ratios"] == [0.6, 0.55, 0.4]
    assert sliding["median_ratio"] == 0.55
    assert (sliding["median_meas_per_s"], sliding["min_meas_per_s"]) == (48.0, 44.0)
    assert result["summary"]["tumbling"]["median_ratio"] == 1.0
    assert all(row["exact"] for row in result["summary"].values())
    assert "sliding" in format_comparison(result)


def test_a_lost_measurement_in_any_step_marks_the_kind_not_exact() -> None:
    def run_one(kind: str) -> dict[str, object]:
        lost = 1 if kind == "count" else 0
        return {
            "achieved_meas_per_s": 10.0,
            "lost_measurements": lost,
            "duplicated_measurements": 0,
        }

    summary = compare_kinds(("tumbling", "count"), 1, run_one)["summary"]

    assert summary["tumbling"]["exact"]
    assert not summary["count"]["exact"]


@pytest.mark.parametrize("text", ["", " , ", "tumbling,count,tumbling"])
def test_kind_lists_must_name_each_kind_once(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_kinds(text)
