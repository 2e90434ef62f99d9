"""Rules with a real broker: where/derive/having/UDF/UDAF results and alerts equal the oracle.

The data set's rows carry a unit (``C`` or ``F``); ``derive`` converts Fahrenheit to Celsius
and flags implausible readings, ``where`` drops those and one sensor; ``having`` keeps keys
with at least three rows; an alert fires after two consecutive windows whose maximum is
above 30 °C and resolves at the first window whose maximum is below 25 °C. The conditions use
exact aggregates (rows, max) so that no float rounding can decide a comparison. Duplicated and
reordered deliveries, 1 and 3 workers, 1 and 2 partitions.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import PipelineSpec
from shoal.schemas.topics import Topics
from tests.support.datasets import make_batches, two_window_spec
from tests.support.in_memory import shuffled_with_duplicates
from tests.support.rules_oracle import (
    RULES,
    RulesRun,
    example_functions,
    example_rules,
    expected_transitions,
    run_rules_against_oracle,
    with_attributes,
)

pytestmark = pytest.mark.broker


def _run(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, spec: PipelineSpec, seed: int
) -> RulesRun:
    """``spec`` over attribute data from 3 gateways, 20 % duplicated, shuffled; the oracle's."""
    workers = 1 if spec.partitions == 1 else 3
    batches = with_attributes(
        make_batches(
            seed=seed + workers, gateways=3, batches_per_gateway=30, rows_per_batch=(0, 80)
        ),
        seed=workers,
    )
    order = shuffled_with_duplicates(len(batches), np.random.default_rng(workers), 0.2)
    return asyncio.run(
        run_rules_against_oracle(
            spec,
            batches,
            order,
            settings=broker.settings,
            topics=topics,
            workers=workers,
            state_dir=tmp_path,
        )
    )


@pytest.mark.parametrize(
    "partitions", [1, 2], ids=["1-worker-1-partition", "3-workers-2-partitions"]
)
def test_rules_equal_the_oracle(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, partitions: int
) -> None:
    spec = two_window_spec(
        "rules", ["count", "mean", "max"], partitions, checkpoint_interval_ms=200, **RULES
    )
    run = _run(broker, topics, tmp_path, spec, seed=11)
    want, closed, seen, pipeline = run.want, run.closed, run.seen, run.pipeline
    assert 0 < want.published.filter(closed).height < want.results.filter(closed).height
    counters = [c.core.counters for c in pipeline.combiners]
    withheld = want.results.filter(closed).join(
        want.published, on=["window", "start", "key"], how="anti"
    )
    assert sum(c.results_withheld for c in counters) == withheld.height
    assert sum(c.rows_withheld for c in counters) == withheld["rows"].sum()
    # Workers count per delivery (the data set duplicates some): at least every row once.
    assert sum(w.counters.rows_filtered for w in pipeline.workers) >= want.filtered
    # Alerts: exactly the oracle's transitions, each published once.
    expected = expected_transitions(want.results.filter(closed), spec)
    got = [(a["alert"], a["key"], a["start"], a["state"]) for a in seen.alerts]
    assert len(got) == len(set(got)), "a transition was published twice"
    assert set(got) == expected
    assert {s for *_, s in expected} == {"firing", "resolved"}


@pytest.mark.parametrize(
    "partitions", [1, 2], ids=["1-worker-1-partition", "3-workers-2-partitions"]
)
def test_udf_and_udaf_equal_plain_polars(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, partitions: int
) -> None:
    """The UDF and UDAF examples together (``example_functions``): a calibration UDF in
    derive, a plausibility UDF as where, the ewm UDAF. The oracle computes the same in plain
    polars (``USER_FUNCTIONS``, ``oracle.USER_AGGREGATES``): no user code is called to compute
    what the pipeline must publish."""
    spec = two_window_spec(
        "functions",
        ["count", "mean", "max", "ewm"],
        partitions,
        checkpoint_interval_ms=200,
        **example_functions(),
    )
    assert spec.calls_functions
    run = _run(broker, topics, tmp_path, spec, seed=21)
    assert not run.seen.deadletters
    for worker in run.pipeline.workers:
        health = worker.stats.functions_health()["functions"]
        assert health["batches_ok"] > 0
        assert health["failures"] == {}


@pytest.mark.parametrize(
    "partitions", [1, 2], ids=["1-worker-1-partition", "3-workers-2-partitions"]
)
def test_udfs_inside_sql_equal_plain_polars(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, partitions: int
) -> None:
    """``processors/examples/udf-in-sql.toml``: a UDF inside a CASE (on an SQL argument),
    a bool UDF with a literal argument inside a larger condition. The oracle writes the same
    expressions in plain polars (``USER_FUNCTIONS``)."""
    spec = two_window_spec(
        "udfsql",
        ["count", "mean", "min", "max"],
        partitions,
        checkpoint_interval_ms=200,
        **example_rules("udf-in-sql.toml"),
    )
    assert spec.calls_functions
    run = _run(broker, topics, tmp_path, spec, seed=31)
    assert not run.seen.deadletters
    for worker in run.pipeline.workers:
        health = worker.stats.functions_health()["udfsql"]
        assert health["batches_ok"] > 0
        assert health["failures"] == {}
