"""Exactness without a broker: any split, order, duplication, workers and partitions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.processors.aggregates import AGGREGATES
from shoal.processors.spec import parse_pipeline
from tests.support.datasets import all_rows, make_batches
from tests.support.in_memory import check_against_oracle, run_in_memory
from tests.support.oracle import expected_results

ALL_AGGREGATES = [*AGGREGATES, "p50", "p95", "p99"]


def spec_for(
    windows: list[dict], partitions: int, lateness_ms: int, allowed_lateness_ms: int = 0
) -> object:
    return parse_pipeline(
        {
            "name": "t",
            "windows": windows,
            "aggregates": ALL_AGGREGATES,
            "partitions": partitions,
            "lateness_ms": lateness_ms,
            "allowed_lateness_ms": allowed_lateness_ms,
            "idle_timeout_ms": 1_000,
        }
    )


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_tumbling_all_aggregates(partitions: int, workers: int) -> None:
    spec = spec_for([{"kind": "tumbling", "size_ms": 2_000}], partitions, lateness_ms=1_000)
    batches = make_batches(seed=partitions * 10 + workers, gateways=3, batches_per_gateway=15)
    check_against_oracle(spec, batches, seed=workers, workers=workers)


def test_hopping_and_tumbling_side_by_side() -> None:
    spec = spec_for(
        [
            {"kind": "tumbling", "size_ms": 1_000},
            {"kind": "hopping", "size_ms": 3_000, "slide_ms": 1_000},
        ],
        2,
        lateness_ms=500,
    )
    check_against_oracle(spec, make_batches(seed=7, gap_every=4), seed=3)


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_corrections_fold_rows_within_allowed_lateness(partitions: int, workers: int) -> None:
    """Final revisions equal the oracle over every row within lateness + allowed lateness."""
    spec = spec_for(
        [{"kind": "tumbling", "size_ms": 2_000}], partitions, 1_000, allowed_lateness_ms=6_000
    )
    batches = make_batches(seed=partitions * 10 + workers, gateways=3, batches_per_gateway=20)
    _, _, combiners = run_in_memory(spec, batches, seed=workers, workers=workers, reorder_within=4)
    # The data must exercise both sides: rows folded into closed windows, and rows beyond.
    assert sum(c.counters.rows_corrected for c in combiners) > 0
    assert sum(c.counters.corrections_emitted for c in combiners) > 0
    assert sum(c.counters.rows_late for c in combiners) > 0
    check_against_oracle(spec, batches, seed=workers, workers=workers, reorder_within=4)


SLIDING = {"kind": "sliding", "size_ms": 3_000, "step_ms": 500}


def _sparse(seed: int, batches_per_gateway: int = 15) -> list:
    """Many keys, few rows each: a key has no row in the last step of many of its windows."""
    return make_batches(seed=seed, gateways=3, batches_per_gateway=batches_per_gateway, keys=40)


def _untriggered(batches: list, spec) -> int:
    """(window, key) groups with rows that ``spec``'s sliding trigger leaves out."""
    window = spec.windows[0]
    hopping = {"kind": "hopping", "size_ms": window.size_ms, "slide_ms": window.slide_ms}
    holding = spec_for([hopping], spec.partitions, spec.lateness_ms, spec.allowed_lateness_ms)
    rows = all_rows(batches)
    return expected_results(rows, holding)[0].height - expected_results(rows, spec)[0].height


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 3, 5])
def test_sliding_all_aggregates(partitions: int, workers: int) -> None:
    spec = spec_for([SLIDING], partitions, lateness_ms=1_000)
    batches = _sparse(seed=partitions * 10 + workers)
    assert _untriggered(batches, spec) > 0  # the trigger has something to leave out
    check_against_oracle(spec, batches, seed=workers, workers=workers)


@pytest.mark.parametrize("workers", [1, 3])
def test_sliding_corrections(workers: int) -> None:
    """Late rows within the allowed lateness revise sliding windows (and may trigger them:
    ``test_sliding.py``); final revisions equal the oracle."""
    spec = spec_for([SLIDING], 2, 1_000, allowed_lateness_ms=6_000)
    batches = _sparse(seed=workers, batches_per_gateway=20)
    _, _, combiners = run_in_memory(spec, batches, seed=workers, workers=workers, reorder_within=4)
    assert sum(c.counters.corrections_emitted for c in combiners) > 0
    assert sum(c.counters.rows_late for c in combiners) > 0
    check_against_oracle(spec, batches, seed=workers, workers=workers, reorder_within=4)


def test_no_allowed_lateness_emits_each_window_once() -> None:
    spec = spec_for([{"kind": "tumbling", "size_ms": 2_000}], 2, 1_000)
    batches = make_batches(seed=5, gateways=3, batches_per_gateway=15)
    _, _, combiners = run_in_memory(spec, batches, seed=1)
    for combiner in combiners:
        assert combiner.counters.corrections_emitted == 0
        assert combiner.counters.rows_corrected == 0
        assert combiner.revisions == {}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gateways=st.integers(1, 3),
    batches=st.integers(1, 10),
    size_ms=st.sampled_from([500, 1_000, 3_000]),
    kind=st.sampled_from(["tumbling", "hopping", "sliding"]),
    partitions=st.integers(1, 2),
    lateness_ms=st.sampled_from([0, 300, 2_000]),
    allowed_lateness_ms=st.sampled_from([0, 0, 700, 5_000]),
    duplicate_fraction=st.floats(0.0, 1.0),
    reorder_within=st.sampled_from([None, 2, 5]),
)
def test_property_any_split_order_and_duplication(
    seed,
    gateways,
    batches,
    size_ms,
    kind,
    partitions,
    lateness_ms,
    allowed_lateness_ms,
    duplicate_fraction,
    reorder_within,
) -> None:
    window = {
        "tumbling": {"kind": "tumbling", "size_ms": size_ms},
        "hopping": {"kind": "hopping", "size_ms": size_ms * 2, "slide_ms": size_ms},
        "sliding": {"kind": "sliding", "size_ms": size_ms * 2, "step_ms": size_ms // 2},
    }[kind]
    spec = spec_for([window], partitions, lateness_ms, allowed_lateness_ms)
    data = make_batches(seed=seed, gateways=gateways, batches_per_gateway=batches, gap_every=3)
    check_against_oracle(
        spec, data, seed=seed, duplicate_fraction=duplicate_fraction, reorder_within=reorder_within
    )
