"""The matrix's logic without processes: search, summaries, ratios, targets, tables, plots.

``run_baseline`` and ``run_pipeline`` are replaced by models of a system with a fixed
capacity, so the whole document is built (grid, searches, encoding study) in seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal._cli.common import load_spec
from shoal.loadtest import bench_matrix, bench_plots, bench_report
from shoal.loadtest.baseline.bench import BaselineBenchConfig
from shoal.loadtest.bench_matrix import Cell, MatrixPlan, MaxPlan, Variant, search_max
from shoal.loadtest.bench_pipeline import PipelineBenchConfig

BASELINE_CAPACITY = 100_000.0
SHOAL_CAPACITY = 2_000_000.0


def _latency(p50: float) -> dict[str, Any]:
    cdf = [[q, p50 * (0.5 + q)] for q in (0.01, 0.5, 0.9, 0.99)]
    return {"p50": p50, "p95": p50 * 1.4, "p99": p50 * 1.5, "max": p50 * 2, "n": 10, "cdf": cdf}


def _fake_baseline(config: BaselineBenchConfig, _progress: object) -> dict[str, Any]:
    offered = config.offered
    capacity = BASELINE_CAPACITY * config.instances
    achieved = min(offered, capacity)
    cpu = 100.0 * achieved / BASELINE_CAPACITY
    return {
        "system": "baseline",
        "offered_meas_per_s": offered,
        "achieved_meas_per_s": achieved,
        "sustained": offered <= capacity,
        "unprocessed_measurements": 0 if offered <= capacity else 1000,
        "mean_batch_rows": float(config.batch),
        "t_ex_ms": _latency(20.0),
        "t_rr_ms": _latency(100.0),
        "bytes_per_meas": 120.0,
        "window_components": [
            {"name": f"baseline-{i}", "cpu_percent": cpu / config.instances, "rss_mb": 70.0}
            for i in range(config.instances)
        ]
        + [{"name": "driver", "cpu_percent": 50.0, "rss_mb": 90.0}],
    }


def _fake_shoal(config: PipelineBenchConfig, _progress: object) -> dict[str, Any]:
    offered = {"A": 1_000, "B": 10_000}[config.scenario] * config.rate
    achieved = min(offered, SHOAL_CAPACITY)
    return {
        "scenario": config.scenario,
        "batch": config.batch,
        "duration_s": config.duration_s,
        "offered_meas_per_s": offered,
        "simulator_meas_per_s": offered,
        "achieved_meas_per_s": achieved,
        "lag_at_end_measurements": 0 if offered <= SHOAL_CAPACITY else 10 * offered,
        "sustained": offered <= SHOAL_CAPACITY,
        "lost_measurements": 0,
        "duplicated_measurements": 0,
        "late_measurements": 0,
        "unconfirmed_batches": 0,
        "generated_measurements": 1000,
        "batches_published": 10,
        "apply_latency_ms": _latency(10.0),
        "worker_handle_ms": _latency(2.0),
        "publish_to_partial_ms": _latency(4.0),
        "bytes_per_meas": 12.7,
        "components": [
            {"name": n, "rss_mb": 50.0} for n in ("broker", "combiner-0", "worker-0", "simulator")
        ],
        "window_components": [
            {"name": "broker", "cpu_percent": 5.0},
            {"name": "combiner-0", "cpu_percent": 20.0},
            {"name": "worker-0", "cpu_percent": 25.0},
            {"name": "simulator", "cpu_percent": 60.0},  # a load generator: never counted
        ],
    }


@pytest.fixture(scope="module")
def document() -> Iterator[dict[str, Any]]:
    plan = MatrixPlan(
        "test",
        (Cell("A", 25.0, 4_000), Cell("A", 25.0, 16_000)),
        (Variant(),),
        ((Cell("A", 25.0, 4_000), Variant(pipeline="default")),),
        duration_s=1.0,
        max_search=MaxPlan(max_steps=6),
        study_rows=500,
        study_repeats=1,
        machine_cores=2,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_matrix, "run_baseline", _fake_baseline)
        patch.setattr(bench_matrix, "run_pipeline", _fake_shoal)
        yield bench_matrix.run(plan, load_spec)


def test_search_steps_up_then_bisects_to_the_capacity() -> None:
    seen: list[float] = []

    def measure(rate: float) -> dict[str, Any]:
        seen.append(rate)
        return {"sustained": rate <= 37.0, "achieved_meas_per_s": rate * 1000, "sut_cpu_percent": 1}

    found = search_max(measure, 10.0, factor=2.0, max_steps=8, tolerance=0.1)
    assert seen[:3] == [10.0, 20.0, 40.0]
    assert 37.0 / 1.1 <= found["max_sustained_rate_per_sensor"] <= 37.0
    assert found["first_failed_rate_per_sensor"] <= 37.0 * 1.1
    assert found["max_sustained_meas_per_s"] == found["max_sustained_rate_per_sensor"] * 1000


def test_search_steps_down_when_the_first_rate_fails_and_respects_max_steps() -> None:
    def measure(rate: float) -> dict[str, Any]:
        return {"sustained": rate <= 3.0, "achieved_meas_per_s": rate}

    found = search_max(measure, 100.0, factor=2.0, max_steps=3)
    assert [s["rate_per_sensor"] for s in found["steps"]] == [100.0, 50.0, 25.0]
    assert found["best"] is None
    assert found["max_sustained_meas_per_s"] == 0.0


def test_summaries_count_the_system_under_test_only(document: dict[str, Any]) -> None:
    cell = document["cells"][0]
    ours = cell["shoal"][0]
    assert ours["sut_cpu_percent"] == 50.0  # broker + combiner + worker, not the simulator
    assert ours["sut_rss_mb"] == 150.0
    assert ours["per_core_meas_per_s"] == pytest.approx(25_000 / 0.5)
    assert ours["t_rr_ms"]["p99"] == 15.0  # the combiner's apply latency
    assert ours["loss_measurements"] == 0
    base = cell["baseline"]
    assert base["sut_cpu_percent"] == 25.0  # the Waitress process, not the driver
    assert base["t_rr_ms"]["p99"] == 150.0
    assert ours["vs_baseline"]["t_rr_p99"] == pytest.approx(0.1)
    assert ours["vs_baseline"]["bytes_per_meas"] == pytest.approx(12.7 / 120.0, rel=1e-3)


def test_the_document_has_every_part_and_the_targets(document: dict[str, Any]) -> None:
    assert [len(c["shoal"]) for c in document["cells"]] == [2, 1]
    assert [s["variant"] for s in document["cells"][0]["shoal"]] == [
        "binary-columnar",
        "binary-columnar, default",
    ]
    searches = document["max_sustained"]
    assert set(searches) == {"baseline_one", "shoal_one", "baseline_machine", "shoal_machine"}
    assert searches["baseline_one"]["max_sustained_meas_per_s"] <= BASELINE_CAPACITY
    assert searches["baseline_machine"]["max_sustained_meas_per_s"] > BASELINE_CAPACITY
    throughput = document["targets"]["throughput_per_core"]
    assert throughput["ratio"] == pytest.approx(
        throughput["shoal_per_core"] / throughput["baseline_per_core"], rel=1e-2
    )
    assert document["targets"]["p99_t_rr_at_A_4000"]["ratio"] == pytest.approx(0.1)
    assert document["targets"]["p99_t_rr_at_A_4000"]["target"] == "<= 0.35"
    # publish -> partials out against the baseline's request -> reply: 6 ms / 150 ms
    to_partial = document["targets"]["p99_publish_to_partial_at_A_4000"]
    assert to_partial["ratio"] == pytest.approx(0.04)
    assert to_partial["target"] == "<= 0.2"
    codecs = {(r["codec"], r["attributes"]) for r in document["encodings"]}
    assert ("binary-columnar+zstd", 10) in codecs
    assert ("baseline: JSON rows + pandas", 1) in codecs


def test_markdown_has_every_table(document: dict[str, Any]) -> None:
    text = bench_report.markdown(document)
    for heading in ("### Targets", "### The grid", "### shoal / baseline", "### Highest sustained"):
        assert heading in text
    assert "| A | 25 | 4,000 | baseline |" in text
    assert "binary-columnar+zstd" in text
    assert "| 6.0 ms vs 150.0 ms | 0.04x | <= 0.2 |" in text  # publish -> partials out


def test_plots_are_written(document: dict[str, Any], tmp_path: Path) -> None:
    written = bench_plots.write_plots(document, tmp_path)
    assert sorted(p.name for p in written) == [
        "cpu-memory.png",
        "encodings.png",
        "throughput.png",
        "trr-cdf.png",
    ]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_plans_fit_their_budgets() -> None:
    quick = bench_matrix.quick_plan()
    assert Cell(*bench_matrix.TARGET_CELL) in quick.cells
    assert quick.max_search is not None
    assert quick.max_search.batch == 16_000
    full = bench_matrix.full_plan()
    assert len(full.cells) == 24
    assert len(full.runs()) == 24 * 5 + 1
    # Cells whose batches take long to fill run long enough for five of them.
    assert full.duration_for(Cell("A", 4.0, 64_000)) == pytest.approx(80.0)


def test_the_verdict_allows_one_batch_per_gateway_of_counting_error() -> None:
    record = {
        "sustained": False,
        "scenario": "A",
        "batch": 16_000,
        "duration_s": 8.0,
        "offered_meas_per_s": 25_000.0,
        "simulator_meas_per_s": 25_010.0,
        "achieved_meas_per_s": 23_000.0,  # 11.5 of 12.5 batches counted in the window
        "lost_measurements": 0,
        "duplicated_measurements": 0,
        "unconfirmed_batches": 0,
        "lag_at_end_measurements": 16_000,
    }
    assert bench_matrix._shoal_sustained(record)
    assert not bench_matrix._shoal_sustained({**record, "achieved_meas_per_s": 20_000.0})
    assert not bench_matrix._shoal_sustained({**record, "lost_measurements": 1})
    assert not bench_matrix._shoal_sustained({**record, "lag_at_end_measurements": 60_000})
