"""``shoal bench adapt``: device messages per second one adapter process takes, and two.

Everything on this machine, against an embedded Mosquitto (dev profile). Each phase preloads
the broker: the consumers subscribe with persistent sessions and leave, the device messages
are published (``--publishers`` paho processes), then the consumers come back and the clock
runs from their subscription until everything has come out the other side, so the figure is
the consumer's rate, not the publishers'. Phases:

1. the broker's own limit, three plain subscribers that do no work, each draining the same
   backlog (QoS 1, Receive Maximum as the adapter's): ``mosquitto_sub`` (C, libmosquitto,
   counted with ``-C``), a Python one on ``BatchedSession`` (acknowledging what one read
   returned in one write, as the adapter does) and one on ``AsyncSession`` (aiomqtt over
   paho, one PUBACK per message; the first ``PAHO_FLOOR_MESSAGES`` only): what the broker
   gives, and what each client costs;
2. one ``shoal adapt`` process: rows counted (and confirmed) by a sink on its ingest topic;
3. two ``shoal adapt`` processes sharing the load (JSON and raw only: a Sparkplug node's
   messages must reach one adapter).

``lost_measurements`` is expected rows minus rows the sink counted (deduplicated on gateway
and seq); ``adapter_rss_mb`` the largest resident size sampled. CPU seconds per 1,000 device
messages (the consumer's and the broker's, from ``/proc``) do not depend on how busy the
shared machine was; the 1-minute load average at the start of each phase is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import psutil

from shoal._spawn import spawn_tied
from shoal.adapters.mapping import Batching
from shoal.broker import AsyncSession, BatchedSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.settings import BrokerSettings
from shoal.loadtest._sink import SinkConfig, SinkProcess
from shoal.loadtest.devices import DeviceFleet, DevicePublisher
from shoal.schemas.topics import Topics

STREAM: Final = "bench"
RECEIVE_MAXIMUM: Final = Batching().max_messages
"""The adapters' Receive Maximum (the mappings' ``max_messages`` default)."""
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


class _Cpu:
    """CPU seconds (user + system) of processes between ``__init__`` and ``seconds()``.

    Also how often they went to sleep (voluntary context switches, ``sleeps()``): for the
    broker, about how many times it was woken up for work.
    """

    def __init__(self, *pids: int | None) -> None:
        self._procs = [psutil.Process(p) for p in pids if p is not None]
        self._start = [self._used(p) for p in self._procs]
        self._sleeps = [self._slept(p) for p in self._procs]

    @staticmethod
    def _used(proc: psutil.Process) -> float:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system + times.children_user + times.children_system)

    @staticmethod
    def _slept(proc: psutil.Process) -> int:
        try:
            return int(proc.num_ctx_switches().voluntary)
        except psutil.Error:
            return 0

    def seconds(self) -> float:
        return sum(self._used(p) - s for p, s in zip(self._procs, self._start, strict=True))

    def sleeps(self) -> int:
        return sum(self._slept(p) - s for p, s in zip(self._procs, self._sleeps, strict=True))


class _MachineIdle:
    """Idle CPU seconds of the whole machine (``/proc/stat``) since ``__init__``."""

    def __init__(self) -> None:
        self._start = self._idle()

    @staticmethod
    def _idle() -> float:
        times = psutil.cpu_times()
        return float(times.idle + getattr(times, "iowait", 0.0))

    def seconds(self) -> float:
        return self._idle() - self._start


def _per_1000(cpu_s: float, messages: int) -> float:
    return round(1000.0 * cpu_s / max(1, messages), 4)


async def _drain_python(
    settings: BrokerSettings, filters: list[str], expected: int, client_id: str, *, batched: bool
) -> int:
    """Resume a plain persistent subscriber; count (and acknowledge) until ``expected``.

    It does no work: ``batched`` acknowledges what one read returned at once
    (``BatchedSession.ack_many``), otherwise each message as it comes (aiomqtt over paho).
    """
    count = 0
    factory = BatchedSession if batched else AsyncSession
    async with factory(
        settings,
        client_id,
        clean_start=False,
        session_expiry_s=600,
        receive_maximum=RECEIVE_MAXIMUM,
        manual_ack=True,
    ) as session:
        # No SUBSCRIBE: the persistent session has its subscription (``_join``), and on a
        # slow client the SUBACK waits behind the backlog (aiomqtt times out after 10 s).
        del filters
        if isinstance(session, BatchedSession):
            async for batch in session.message_batches(asyncio.Event()):
                session.ack_many(batch)
                count += len(batch)
                if count >= expected:
                    break
        else:
            async for message in session.messages():
                session.ack(message)
                count += 1
                if count >= expected:
                    break
    return count


def _drain_c(
    port: int, filters: list[str], expected: int, client_id: str
) -> subprocess.Popen[bytes]:
    """``mosquitto_sub`` draining the persistent session ``client_id`` (exits at ``expected``)."""
    args = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-i", client_id, "-V", "5"]
    args += ["-c", "-x", "600", "-q", "1", "-D", "connect", "receive-maximum"]
    args += [str(RECEIVE_MAXIMUM), "-C", str(expected)]
    for f in filters:
        args += ["-t", f]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _join(settings: BrokerSettings, filters: list[str], client_ids: list[str]) -> None:
    """Make persistent sessions for ``client_ids`` subscribed to ``filters``, then leave."""
    for client_id in client_ids:
        async with AsyncSession(
            settings, client_id, clean_start=True, session_expiry_s=600
        ) as session:
            await session.subscribe(filters)


async def _drop(settings: BrokerSettings, client_ids: list[str]) -> None:
    """End sessions: later phases' messages must not queue for them."""
    for client_id in client_ids:
        async with AsyncSession(settings, client_id, clean_start=True, session_expiry_s=0):
            pass


_FLOORS: Final = ("c", "batched", "aiomqtt")
"""The plain subscribers: mosquitto_sub, Python on ``BatchedSession`` (paho, batches), Python
on ``AsyncSession`` (aiomqtt over paho, one message at a time)."""
PAHO_FLOOR_MESSAGES: Final = 20_000
"""The aiomqtt/paho subscriber drains this many (two Receive Maximums' worth) and leaves the
rest: at a few hundred messages/s the whole backlog would take minutes."""


def _floors(broker: EmbeddedBroker, kind: str, load: tuple[int, int, int]) -> dict[str, Any]:
    """Each plain subscriber drains the same backlog, one after the other."""
    count, steps, publishers = load
    filters = [_FILTERS[kind]]
    messages = count * steps + (min(2, count) if kind == "sparkplug" else 0)
    ids = {name: f"bench-plain-{name}" for name in _FLOORS}
    c_sub = shutil.which("mosquitto_sub") is not None
    names = [n for n in _FLOORS if n != "c" or c_sub]
    asyncio.run(_join(broker.settings, filters, [ids[n] for n in names]))
    _publish_all(broker, kind, count, steps, publishers)
    out: dict[str, Any] = {"device_msgs": messages}
    for name in names:
        load_1m = os.getloadavg()[0]
        broker_cpu = _Cpu(broker.pid)
        if name == "c":
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.monotonic()
            proc = _drain_c(broker.port, filters, messages, ids[name])
            _, err = proc.communicate(timeout=600)
            seconds = time.monotonic() - started
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            sub_cpu_s = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
            if proc.returncode != 0:
                raise RuntimeError(f"mosquitto_sub failed: {err.decode(errors='replace')}")
            got = messages
        else:
            own = _Cpu(os.getpid())
            started = time.monotonic()
            batched = name == "batched"
            want = messages if batched else min(messages, PAHO_FLOOR_MESSAGES)
            got = asyncio.run(
                _drain_python(broker.settings, filters, want, ids[name], batched=batched)
            )
            seconds = time.monotonic() - started
            sub_cpu_s = own.seconds()
        out[name] = {
            "msgs": got,
            "msgs_per_s": round(got / max(1e-9, seconds), 1),
            "seconds": round(seconds, 2),
            "subscriber_cpu_s_per_1000_msgs": _per_1000(sub_cpu_s, got),
            "broker_cpu_s_per_1000_msgs": _per_1000(broker_cpu.seconds(), got),
            "broker_wakeups_per_1000_msgs": _per_1000(broker_cpu.sleeps(), got),
            "load_1m": round(load_1m, 2),
        }
    asyncio.run(_drop(broker.settings, [ids[n] for n in names]))
    return out


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
    load_1m = os.getloadavg()[0]
    try:
        procs = [_adapter(broker, mapping, i, tmp, log) for i, log in zip(ids, logs, strict=True)]
        for log in logs:
            _wait_logged(log, "subscribed to", 2)
        started = time.monotonic()
        adapter_cpu = _Cpu(*(p.pid for p in procs))
        broker_cpu = _Cpu(broker.pid)
        sink_cpu = _Cpu(sink.pid)
        idle = _MachineIdle()
        deadline = started + 600
        while sink.counts.rows < expected_rows and time.monotonic() < deadline:
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    peak_rss = max(peak_rss, psutil.Process(proc.pid).memory_info().rss)
            sink.wait_rows(expected_rows, 0.1)
        seconds = time.monotonic() - started
        adapter_cpu_s, broker_cpu_s = adapter_cpu.seconds(), broker_cpu.seconds()
        sink_cpu_s, idle_s = sink_cpu.seconds(), idle.seconds()
        broker_wakeups = broker_cpu.sleeps()
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
        "adapter_cpu_s_per_1000_msgs": _per_1000(adapter_cpu_s, messages),
        "broker_cpu_s_per_1000_msgs": _per_1000(broker_cpu_s, messages),
        "broker_wakeups_per_1000_msgs": _per_1000(broker_wakeups, messages),
        "sink_cpu_s_per_1000_msgs": _per_1000(sink_cpu_s, messages),
        # adapters + broker + counting sink over the phase, in cores: near the machine's
        # count, the phase was bound by CPU, not by the adapters' design
        "cores_busy": round((adapter_cpu_s + broker_cpu_s + sink_cpu_s) / seconds, 2),
        # the whole machine, other sessions and the kernel included: cores minus idle
        "machine_cores_busy": round((psutil.cpu_count() or 1) - idle_s / seconds, 2),
        "device_msgs_per_ack_write": _per_ack_write(logs),
        "load_1m": round(load_1m, 2),
        "publish_s": round(publish_s, 2),
    }


_GROUPS: Final = re.compile(r"adapter \S+: (\d+) messages, .* (\d+) groups acknowledged")


def _per_ack_write(logs: list[Path]) -> float | None:
    """Device messages per PUBACK write, from each adapter's last counters line (at exit)."""
    messages = groups = 0
    for log in logs:
        found = _GROUPS.findall(log.read_text(errors="replace"))
        if found:
            messages += int(found[-1][0])
            groups += int(found[-1][1])
    return round(messages / groups, 1) if groups else None


_FILTERS: Final = {"json": "sensors/+/+", "raw": "home/+/+", "sparkplug": "spBv1.0/#"}


def run(kind: str, *, devices: int = 1000, steps: int = 100, publishers: int = 2) -> dict[str, Any]:
    """The whole benchmark; returns the record ``--json`` writes."""
    load = (devices, steps, publishers)
    with EmbeddedBroker("dev") as broker, tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        floors = _floors(broker, kind, load)
        one = _adapters_phase(broker, kind, 1, load, tmp)
        phases = [one]
        if kind != "sparkplug":
            phases.append(_adapters_phase(broker, kind, 2, load, tmp))
    plain = floors.get("c") or floors["batched"]
    record: dict[str, Any] = {
        "devices": kind,
        "device_msgs_per_s": one["device_msgs_per_s"],
        "meas_per_s": one["meas_per_s"],
        "lost_measurements": sum(p["lost_measurements"] for p in phases),
        "adapter_rss_mb": max(p["adapter_rss_mb"] for p in phases),
        "adapter_cpu_s_per_1000_msgs": one["adapter_cpu_s_per_1000_msgs"],
        "broker_plain_subscriber_msgs_per_s": plain["msgs_per_s"],
        "python_batched_subscriber_msgs_per_s": floors["batched"]["msgs_per_s"],
        "python_aiomqtt_subscriber_msgs_per_s": floors["aiomqtt"]["msgs_per_s"],
        "floors": floors,
        "phases": phases,
        "cores": psutil.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    if len(phases) > 1:
        record["two_adapters_speedup"] = round(
            phases[1]["device_msgs_per_s"] / max(1e-9, one["device_msgs_per_s"]), 2
        )
        # The most a second adapter can add here if the work per message stays what the
        # one-adapter phase measured: the machine's cores over what that phase kept busy.
        record["two_adapters_ceiling"] = round(
            min(2.0, record["cores"] / max(1e-9, one["cores_busy"])), 2
        )
    return record
