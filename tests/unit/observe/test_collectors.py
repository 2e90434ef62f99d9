"""Collectors over real runtime objects (not run): what a scrape says about a partition."""

from __future__ import annotations

from shoal.broker.settings import BrokerSettings
from shoal.clock import FakeClock
from shoal.observe.collectors import CombinerCollector
from shoal.processors.spec import PipelineSpec, default_state_cells, parse_pipeline
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.schemas.control import GatewayStatus


def _status(gateway_id: str, first: int, next_seq: int, at_ms: int) -> GatewayStatus:
    return GatewayStatus(
        gateway_id=gateway_id,
        stream="s",
        next_seq=next_seq,
        first_unconfirmed_seq=first,
        unconfirmed_batches=next_seq - first,
        unconfirmed_rows=0,
        oldest_unconfirmed_ms=None,
        spool_bytes=0,
        rows_total=0,
        at_ms=at_ms,
    )


def _samples(runtime: CombinerRuntime) -> dict[str, float]:
    return {
        s.name: s.value
        for family in CombinerCollector(runtime).collect()
        for s in family.samples
        if s.labels.get("le") in (None, "+Inf")
    }


def test_a_partition_reports_the_batches_gateways_announced_and_it_has_not_applied() -> None:
    clock = FakeClock()
    spec = parse_pipeline({"name": "lagging", "windows": [{"size_ms": 1_000}], "partitions": 2})
    config = CombinerConfig(spec, 1, BrokerSettings.from_url("mqtt://127.0.0.1:1"))
    runtime = CombinerRuntime(config, clock)  # never connected: only its state is read
    before = _samples(runtime)
    assert before["shoal_combiner_lag_batches"] == 0
    assert before["shoal_combiner_gateways"] == 0
    assert "shoal_combiner_watermark_seconds" not in before  # no watermark yet: no sample
    runtime.core.receive_status(_status("g1", first=3, next_seq=10, at_ms=clock.now_ms()))
    runtime.core.receive_status(_status("g2", first=0, next_seq=4, at_ms=clock.now_ms()))
    after = _samples(runtime)
    assert after["shoal_combiner_lag_batches"] == (10 - 3) + (4 - 0)
    assert after["shoal_combiner_gateways"] == 2
    assert after["shoal_combiner_gateways_holding"] == 2  # announced, not applied: they hold
    assert after["shoal_combiner_batches_applied_total"] == 0
    assert after["shoal_combiner_apply_latency_seconds_count"] == 0


def test_a_partition_reports_its_state_cap_sized_from_the_memory_in_its_config() -> None:
    raw = {"name": "capped", "windows": [{"size_ms": 1_000}]}
    broker = BrokerSettings.from_url("mqtt://127.0.0.1:1")

    def cap(spec: PipelineSpec) -> float:
        config = CombinerConfig(spec, 0, broker, memory_bytes=2**30)
        return _samples(CombinerRuntime(config, FakeClock()))["shoal_combiner_max_state_cells"]

    assert cap(parse_pipeline(raw)) == default_state_cells(2**30)
    assert cap(parse_pipeline({**raw, "limits": {"max_state_cells": 5_000}})) == 5_000
