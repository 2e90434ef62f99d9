"""Sessions keep as many QoS 1 publishes in flight as the broker's CONNACK allows.

paho's own default is 20 whatever the broker says: a combiner's window of 1,000 retained
per-key results then took 50 round trips to leave, and the alerts behind them came 40-65 ms
late (docs/benchmarks.md, "Alert latency"). Mosquitto announces its ``max_inflight_messages``
as its Receive Maximum.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.broker import AsyncSession, EmbeddedBroker, ThreadedSession, unique_client_id

ANNOUNCED = 37  # neither paho's default (20) nor any profile's


@pytest.fixture
def quota_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    overrides = {"max_inflight_messages": str(ANNOUNCED)}
    with EmbeddedBroker(data_dir=tmp_path, overrides=overrides, broker="mosquitto") as broker:
        yield broker


def test_the_async_session_adopts_the_brokers_receive_maximum(
    quota_broker: EmbeddedBroker,
) -> None:
    async def scenario() -> int | None:
        async with AsyncSession(quota_broker.settings, unique_client_id("quota")) as session:
            return session.send_quota

    assert asyncio.run(scenario()) == ANNOUNCED


def test_the_threaded_session_adopts_the_brokers_receive_maximum(
    quota_broker: EmbeddedBroker,
) -> None:
    session = ThreadedSession(quota_broker.settings, unique_client_id("quota"))
    session.start()
    try:
        assert session.wait_connected(10)
        assert session.send_quota == ANNOUNCED
    finally:
        session.stop()
