"""The bench's alert probe on a real broker: what it stores, what it leaves out, and the timing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.loadtest.alert_latency import (
    AlertProbe,
    ProbeProcess,
    RecorderProbe,
    alert_after_result,
    stop,
)
from shoal.schemas.topics import Topics
from tests.support.alert_messages import alert_message, result_message


async def _two_windows(combiner: AsyncSession, topics: Topics) -> None:
    """Two window results, each followed 2 ms later (combiner clock) by its transition."""
    for start, state in ((0, "firing"), (1000, "resolved")):
        await combiner.publish(topics.results("p"), result_message(start, 5_000 + start))
        await combiner.publish(
            topics.alert("p", "spike", "s1"),
            alert_message(start, 5_002 + start, state),
            retain=True,
        )


@pytest.mark.timeout(60)
def test_probe_times_each_alert_after_its_result_and_skips_retained_ones(
    broker: EmbeddedBroker, topics: Topics
) -> None:
    async def scenario() -> tuple[AlertProbe, float, float]:
        probe = AlertProbe("p", topics)
        async with (
            AsyncSession(broker.settings, unique_client_id("test-combiner")) as combiner,
            AsyncSession(broker.settings, unique_client_id("test-probe")) as watcher,
        ):
            # A transition from before the probe subscribed: retained, not timed.
            await combiner.publish(
                topics.alert("p", "spike", "s0"), alert_message(-1000, 1), retain=True
            )
            task = asyncio.create_task(probe.run(watcher))
            await asyncio.sleep(0.5)
            since = time.monotonic()
            await _two_windows(combiner, topics)
            for _ in range(200):  # up to 10 s
                if len(probe.alerts) >= 2:
                    break
                await asyncio.sleep(0.05)
            until = time.monotonic()
            await stop(task)
        return probe, since, until

    probe, since, until = asyncio.run(scenario())
    assert probe.retained_alerts == 1
    assert len(probe.results) == 2
    assert len(probe.alerts) == 2
    out = alert_after_result(probe.results, probe.alerts, since=since, until=until)
    assert out["transitions"] == {"firing": 1, "resolved": 1}
    assert out["unmatched"] == 0
    assert out["emitted"] == {"p50": 2.0, "p99": 2.0, "max": 2.0, "count": 2}
    received = out["received"]
    assert received["count"] == 2
    # each alert left after its result's PUBACK: received after it, by the same subscriber
    assert 0.0 <= received["p50"] <= received["max"] < 10_000


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["paho", "mosquitto_sub"])
def test_the_probe_in_its_own_process_stores_the_same(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path, kind: str
) -> None:
    """``ProbeProcess`` and ``RecorderProbe`` (what the bench runs): subscribed before
    ``start`` returns, and ``finish`` brings back what the other process stored, with receive
    times on this clock."""

    async def scenario() -> tuple[AlertProbe, float, float]:
        inner = AlertProbe("p", topics)
        client_id = unique_client_id("probe")
        probe: ProbeProcess | RecorderProbe = (
            ProbeProcess(inner, broker.settings, client_id)
            if kind == "paho"
            else RecorderProbe(inner, broker.settings, client_id, tmp_path / "probe.txt")
        )
        assert probe.kind == kind
        async with AsyncSession(broker.settings, unique_client_id("test-combiner")) as combiner:
            await combiner.publish(
                topics.alert("p", "spike", "s0"), alert_message(-1000, 1), retain=True
            )
            await probe.start()
            since = time.monotonic()
            await _two_windows(combiner, topics)
            await asyncio.sleep(1.0)
            until = time.monotonic()
            return await probe.finish(), since, until

    probe, since, until = asyncio.run(scenario())
    assert probe.retained_alerts == 1
    assert (len(probe.results), len(probe.alerts)) == (2, 2)
    assert all(since <= at <= until for at, _ in (*probe.results, *probe.alerts))
    out = alert_after_result(probe.results, probe.alerts, since=since, until=until)
    assert out["transitions"] == {"firing": 1, "resolved": 1}
    assert out["received"]["count"] == 2
