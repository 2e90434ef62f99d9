"""The combiner's state cap on a real Mosquitto: partials past ``max_state_cells`` arrive
on the dead-letter topic whole (reason ``state_cap_exceeded``), are counted and logged, and
the accepted batches' results equal polars' (docs/guarantees.md "Bounded memory")."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from shoal.broker import default_session_factory
from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas.topics import Topics
from tests.support.state_cap import capped_spec, check_capped, distinct_key_batches, run_capped

pytestmark = pytest.mark.broker


def test_partials_past_the_cap_are_dead_lettered_on_the_broker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.runtime.combiner")
    spec = capped_spec("capped", 2_500)
    batches = distinct_key_batches(8, 1_000)
    with EmbeddedBroker("dev", data_dir=tmp_path / "broker") as broker:
        run = asyncio.run(
            run_capped(
                spec,
                batches,
                broker.settings,
                Topics(root="capped"),
                tmp_path / "state",
                default_session_factory(),
            )
        )
    refused = check_capped(spec, batches, run, caplog.records)
    assert len(refused) >= 2
