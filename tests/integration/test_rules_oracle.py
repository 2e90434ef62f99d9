"""Rules with a real broker: where/derive/having results and alert transitions equal the oracle.

The data set's rows carry a unit (``C`` or ``F``); ``derive`` converts Fahrenheit to Celsius
and flags implausible readings, ``where`` drops those and one sensor; ``having`` keeps keys
with at least three rows; an alert fires after two consecutive windows whose maximum is
above 30 °C and resolves at the first window whose maximum is below 25 °C. The conditions use
exact aggregates (rows, max) so that no float rounding can decide a comparison. Duplicated and
reordered deliveries, 1 and 3 workers, 1 and 2 partitions.
"""

from __future__ import annotations

import asyncio

import numpy as np
import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.processors.spec import PipelineSpec
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.compare import assert_matches_oracle
from tests.support.datasets import make_batches, two_window_spec
from tests.support.in_memory import shuffled_with_duplicates
from tests.support.live import InProcessPipeline, collector, publish_batches
from tests.support.rules_oracle import (
    RULES,
    expected_transitions,
    expected_with_rules,
    rows_of,
    with_attributes,
)

pytestmark = pytest.mark.broker


@pytest.mark.parametrize(("workers", "partitions"), [(1, 1), (3, 2)])
def test_rules_equal_the_oracle(
    broker: EmbeddedBroker, topics: Topics, tmp_path, workers: int, partitions: int
) -> None:
    spec: PipelineSpec = two_window_spec(
        "rules", ["count", "mean", "max"], partitions, checkpoint_interval_ms=200, **RULES
    )
    batches = with_attributes(
        make_batches(seed=11 + workers, gateways=3, batches_per_gateway=30, rows_per_batch=(0, 60)),
        seed=workers,
    )
    order = shuffled_with_duplicates(len(batches), np.random.default_rng(workers), 0.2)

    async def scenario() -> None:
        pipeline = InProcessPipeline(
            spec, broker.settings, topics, workers=workers, state_dir=tmp_path
        )
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            await publish_batches(
                broker.settings, topics, batches, order, encoding=Encoding.BINARY_COLUMNAR
            )
            threshold = await pipeline.finish(batches)
        want = expected_with_rules(rows_of(batches), spec)
        closed = pl.col("end") <= threshold
        assert want.filtered > 0
        assert 0 < want.published.filter(closed).height < want.results.filter(closed).height
        assert_matches_oracle(seen.results_frame(), want.published.filter(closed), spec, want.scale)
        assert sum(item["rows"] for item in seen.late) == want.late
        counters = [c.core.counters for c in pipeline.combiners]
        for c in counters:  # every partition sees every batch: each counts all filtered rows
            assert c.rows_filtered == want.filtered
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

    asyncio.run(scenario())
