"""``shoal bench adapt``: device messages per second one adapter process takes, and two.

Everything on this machine, against an embedded Mosquitto (dev profile). Each phase preloads
the broker: the consumers subscribe with persistent sessions and leave, the device messages
are published (``--publishers`` paho processes), then the consumers come back and the clock
runs from their subscription until everything has come out the other side, so the figure is
the consumer's rate, not the publishers'. Phases:

1. the broker's own limit: a plain subscriber (QoS 1, acknowledging at once) drains the queue;
2. one ``shoal adapt`` process: rows counted (and confirmed) by a sink on its ingest topic;
3. two ``shoal adapt`` processes sharing the load (JSON and raw only: a Sparkplug node's
   messages must reach one adapter).

``lost_measurements`` is expected rows minus rows the sink counted (deduplicated on gateway
and seq); ``adapter_rss_mb`` the largest resident size sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import psutil

from shoal._spawn import spawn_tied
from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.settings import BrokerSettings
from shoal.loadtest._sink import SinkConfig, SinkProcess
from shoal.loadtest.devices import DeviceFleet, DevicePublisher
from shoal.schemas.topics import Topics

STREAM: Final = "bench"
_ROWS_PER_MESSAGE: Final = 2  # temp and hum (JSON, Sparkplug data); raw: 1

_MAPPINGS: Final = {
    "json": """name = "bench"
stream = "bench"
max_future_ms = false
[batching]
max_rows = 20000
max_delay_ms = 250
[[routes]]
topic = "sensors/{site}/{device}"
format = "json-object"
sensor_id = "{site}.{device}"
fields = ["temp", "hum"]
timestamp = { field = "ts", unit = "ms" }
""",
    "raw": """name = "bench"
stream = "bench"
[batching]
max_rows = 20000
max_delay_ms = 250
[[routes]]
topic = "home/{room}/{metric}"
format = "raw"
sensor_id = "{room}"
name = "{metric}"
""",
    "sparkplug": """name = "bench"
stream = "bench"
max_future_ms = false
[batching]
max_rows = 20000
max_delay_ms = 250
[[routes]]
topic = "spBv1.0"
format = "sparkplug"
""",
}


def _publish(port: int, kind: str, count: int, first: int, steps: int) -> None:
    fleet = DeviceFleet(kind, count)
    DevicePublisher(BrokerSettings(port=port), window=2000).run(fleet.messages(first, steps))


def _publish_all(broker: EmbeddedBroker, kind: str, count: int, steps: int, procs: int) -> float:
    """Publish ``count`` devices x ``steps`` steps from ``procs`` processes; seconds taken."""
    if kind == "sparkplug":
        procs = 1  # one node sequence: births first, seq in order
    started = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    share = max(1, steps // procs)
    jobs = []
    for i in range(procs):
        first = i * share
        n = steps - first if i == procs - 1 else share
        jobs.append(ctx.Process(target=_publish, args=(broker.port, kind, count, first, n)))
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    return time.monotonic() - started


async def _drain_plain(settings: BrokerSettings, filters: list[str], expected: int) -> float:
    """Subscribe as a plain persistent subscriber and count until ``expected``; msgs/s."""
    count = 0
    started = 0.0
    client_id = "bench-plain"
    async with AsyncSession(
        settings,
        client_id,
        clean_start=False,
        session_expiry_s=600,
        receive_maximum=1000,
        manual_ack=True,
    ) as session:
        await session.subscribe(filters)
        started = time.monotonic()
        async for message in session.messages():
            session.ack(message)  # at once: the subscriber does no work
            count += 1
            if count >= expected:
                break
    rate = count / max(1e-9, time.monotonic() - started)
    async with AsyncSession(settings, client_id, clean_start=True, session_expiry_s=0):
        pass  # drop the session: later phases' messages must not queue for it
    return rate


async def _join_plain(settings: BrokerSettings, filters: list[str]) -> None:
    async with AsyncSession(
        settings, "bench-plain", clean_start=False, session_expiry_s=600
    ) as session:
        await session.subscribe(filters)


def _adapter(
    broker: EmbeddedBroker, mapping: Path, adapter_id: str, spool: Path, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:
        return spawn_tied(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                "-v",
                "adapt",
                f"--mapping={mapping}",
                f"--id={adapter_id}",
                f"--spool-dir={spool / adapter_id}",
                f"--broker=mqtt://127.0.0.1:{broker.port}",
                "--stats-interval=3600",
            ],
            stderr=err,
            stdout=subprocess.DEVNULL,
        )


def _wait_logged(log: Path, text: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while log.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-1500:]
            raise TimeoutError(f"{log}: {text!r} not logged; its log ends:\n{tail}")
        time.sleep(0.02)


def _adapters_phase(
    broker: EmbeddedBroker, kind: str, n: int, load: tuple[int, int, int], tmp: Path
) -> dict[str, Any]:
    """``n`` adapters drain ``load`` = (devices, steps, publisher processes)."""
    count, steps, publishers = load
    mapping = tmp / f"mapping-{kind}.toml"
    # A group per phase: the last phase's sessions, offline, would otherwise take a share.
    mapping.write_text(f'group = "bench-{n}"\n' + _MAPPINGS[kind], encoding="utf-8")
    ids = [f"bench-{kind}-{n}-{i}" for i in range(n)]
    logs = [tmp / f"{i}.log" for i in ids]
    procs = [_adapter(broker, mapping, i, tmp, log) for i, log in zip(ids, logs, strict=True)]
    for log in logs:
        _wait_logged(log, "subscribed to", 1)
    for proc in procs:  # leave; the persistent sessions keep their share
        proc.terminate()
        proc.wait()
    publish_s = _publish_all(broker, kind, count, steps, publishers)
    rows_per = 1 if kind == "raw" else _ROWS_PER_MESSAGE
    expected_rows = count * steps * rows_per
    sink = SinkProcess(SinkConfig.from_settings(broker.settings, Topics(), STREAM, confirm=True))
    peak_rss = 0
    try:
        procs = [_adapter(broker, mapping, i, tmp, log) for i, log in zip(ids, logs, strict=True)]
        for log in logs:
            _wait_logged(log, "subscribed to", 2)
        started = time.monotonic()
        deadline = started + 600
        while sink.counts.rows < expected_rows and time.monotonic() < deadline:
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    peak_rss = max(peak_rss, psutil.Process(proc.pid).memory_info().rss)
            sink.wait_rows(expected_rows, 0.2)
        seconds = time.monotonic() - started
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
        counts = sink.stop()
        sink.close()
    messages = count * steps
    return {
        "adapters": n,
        "device_msgs": messages,
        "device_msgs_per_s": round(messages / seconds, 1),
        "meas_per_s": round(counts.rows / seconds, 1),
        "lost_measurements": max(0, expected_rows - counts.rows),
        "extra_measurements": max(0, counts.rows - expected_rows),
        "adapter_rss_mb": round(peak_rss / 2**20, 1),
        "seconds": round(seconds, 2),
        "publish_s": round(publish_s, 2),
    }


def run(kind: str, *, devices: int = 1000, steps: int = 100, publishers: int = 2) -> dict[str, Any]:
    """The whole benchmark; returns the record ``--json`` writes."""
    filters = {"json": "sensors/+/+", "raw": "home/+/+", "sparkplug": "spBv1.0/#"}[kind]
    nodes = min(2, devices)  # DeviceFleet's Sparkplug nodes: one NBIRTH each
    messages = devices * steps + (nodes if kind == "sparkplug" else 0)
    with EmbeddedBroker("dev") as broker, tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        asyncio.run(_join_plain(broker.settings, [filters]))
        _publish_all(broker, kind, devices, steps, publishers)
        broker_limit = asyncio.run(_drain_plain(broker.settings, [filters], messages))
        load = (devices, steps, publishers)
        one = _adapters_phase(broker, kind, 1, load, tmp)
        phases = [one]
        if kind != "sparkplug":
            phases.append(_adapters_phase(broker, kind, 2, load, tmp))
    record: dict[str, Any] = {
        "devices": kind,
        "device_msgs_per_s": one["device_msgs_per_s"],
        "meas_per_s": one["meas_per_s"],
        "lost_measurements": sum(p["lost_measurements"] for p in phases),
        "adapter_rss_mb": max(p["adapter_rss_mb"] for p in phases),
        "broker_plain_subscriber_msgs_per_s": round(broker_limit, 1),
        "phases": phases,
        "cores": psutil.cpu_count(),
    }
    if len(phases) > 1:
        record["two_adapters_speedup"] = round(
            phases[1]["device_msgs_per_s"] / max(1e-9, one["device_msgs_per_s"]), 2
        )
    return record
