"""Device-native ingest on a real Mosquitto: devices → adapters → pipeline, against the oracle;
kill -9 of an adapter while a second one shares the load: nothing lost, nothing counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import polars as pl

from shoal._spawn import spawn_tied
from shoal.adapters import Adapter, AdapterConfig, load_mapping, parse_mapping
from shoal.adapters._proto import sparkplug_b_pb2 as pb
from shoal.adapters.mapping import Mapping
from shoal.broker import AsyncSession, BatchedSession, ThreadedSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message, unique_client_id
from shoal.loadtest.devices import DeviceFleet, DevicePublisher
from shoal.loadtest.sparkplug_encode import device_message, node_birth, node_death
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.schemas.topics import Topics
from tests.integration._gateway_support import Confirmer, stop_process
from tests.support.compare import assert_matches_oracle, scale_of
from tests.support.live import InProcessPipeline, collector, until
from tests.support.oracle import expected_results

STREAM = "devices"


def _spec(name: str, **settings: Any) -> PipelineSpec:
    return parse_pipeline(
        {
            "name": name,
            "windows": [{"kind": "tumbling", "size_ms": 5_000}],
            "aggregates": ["count", "sum", "min", "max", "mean"],
            "lateness_ms": 2_000,
            "idle_timeout_ms": 1_500,
            "limits": {"max_future_ms": False},
            **settings,
        }
    )


def _json_mapping(root: str) -> Mapping:
    return parse_mapping(
        {
            "name": "sensors",
            "stream": STREAM,
            "max_future_ms": False,
            "batching": {"max_rows": 500, "max_delay_ms": 100},
            "routes": [
                {
                    "topic": f"{root}/sensors/{{site}}/{{device}}",
                    "format": "json-object",
                    "sensor_id": "{site}.{device}",
                    "fields": ["temp", "hum"],
                    "timestamp": {"field": "ts", "unit": "ms"},
                    "units": {"temp": "C", "hum": "%"},
                }
            ],
        }
    )


def _confirmed(adapter: Adapter) -> bool:
    stats = adapter.gateway.stats()
    return stats.confirmed_seq >= stats.next_seq - 1


def _oracle_rows(frame: pl.DataFrame) -> pl.DataFrame:
    # One pseudo batch: the devices' rows arrive in event-time order, so none is late and
    # the oracle does not depend on how the adapters cut batches.
    return frame.select(pl.col("sensor_id").alias("key"), "ts", "value").with_columns(
        gateway_id=pl.lit("devices"), seq=pl.lit(0, dtype=pl.Int64)
    )


def test_json_devices_through_two_adapters_equal_the_oracle(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    fleet = DeviceFleet("json", 40, prefix=f"{topics.root}/sensors")
    steps = 30
    mapping = _json_mapping(topics.root)
    spec = _spec("adapt-json")

    async def scenario() -> None:
        pipeline = InProcessPipeline(
            spec, broker.settings, topics, workers=2, state_dir=tmp_path / "state"
        )
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            adapters = [
                Adapter(
                    AdapterConfig(
                        mapping,
                        f"ad{i}",
                        broker=broker.settings,
                        topics=topics,
                        spool_dir=tmp_path / f"ad{i}",
                        resend_after_ms=500,
                    )
                )
                for i in range(2)
            ]
            tasks = [asyncio.create_task(a.run()) for a in adapters]
            for adapter in adapters:
                await asyncio.wait_for(adapter.ready.wait(), 10)
            publisher = DevicePublisher(broker.settings)
            report = await asyncio.to_thread(publisher.run, fleet.messages(0, steps))
            assert report.acknowledged == report.sent == fleet.count * steps
            expected_rows = fleet.count * steps * 2
            await until(
                lambda: sum(a.stats.rows for a in adapters) >= expected_rows, 30, "every row sealed"
            )
            await until(lambda: all(_confirmed(a) for a in adapters), 30, "the pipeline to confirm")
            max_ts = fleet.ts(steps - 1)
            threshold = await pipeline.wait_closed_through(max_ts - spec.lateness_ms)
            await asyncio.sleep(0.5)
            for adapter in adapters:
                adapter.stop()
            await asyncio.gather(*tasks)
            await pipeline.stop()
        assert all(a.stats.messages > 0 for a in adapters), "the second adapter took no share"
        assert sum(a.stats.messages for a in adapters) == report.sent
        assert sum(sum(a.stats.refused.values()) for a in adapters) == 0
        rows = _oracle_rows(fleet.expected_rows(steps))
        expected, late = expected_results(rows, spec)
        assert late == 0
        expected = expected.filter(pl.col("end") <= threshold)
        emitted = seen.results_frame().filter(pl.col("end") <= threshold)
        assert expected.height > 0
        assert_matches_oracle(emitted, expected, spec, scale_of(rows, spec), skip=("batches",))

    asyncio.run(scenario())


def test_raw_values_per_key_equal_the_oracle(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    """Raw values carry no event time: the adapter stamps arrival time, so the windows depend
    on timing; per key, over all windows, counts and sums must still be exact."""
    fleet = DeviceFleet("raw", 25, prefix=f"{topics.root}/home")
    steps = 20
    mapping = parse_mapping(
        {
            "name": "home",
            "stream": STREAM,
            "batching": {"max_rows": 200, "max_delay_ms": 100},
            "routes": [
                {
                    "topic": f"{topics.root}/home/{{room}}/{{metric}}",
                    "format": "raw",
                    "sensor_id": "{room}",
                    "name": "{metric}",
                }
            ],
        }
    )
    spec = _spec("adapt-raw", windows=[{"kind": "tumbling", "size_ms": 1_000}], lateness_ms=200)

    async def scenario() -> None:
        pipeline = InProcessPipeline(spec, broker.settings, topics, workers=1, state_dir=None)
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            adapter = Adapter(AdapterConfig(mapping, "raw1", broker=broker.settings, topics=topics))
            task = asyncio.create_task(adapter.run())
            await asyncio.wait_for(adapter.ready.wait(), 10)
            publisher = DevicePublisher(broker.settings)
            await asyncio.to_thread(publisher.run, fleet.messages(0, steps))
            await until(lambda: adapter.stats.rows >= fleet.count * steps, 30, "rows")
            # a last reading two windows later moves the watermark past every real window
            await asyncio.sleep(2.5)
            sentinel = DevicePublisher(broker.settings)
            await asyncio.to_thread(
                sentinel.run, iter([(f"{topics.root}/home/sentinel/temp", b"0")])
            )
            last_ts = int(time.time() * 1000) - 2_400
            await pipeline.wait_closed_through(last_ts)
            await asyncio.sleep(0.5)
            adapter.stop()
            await task
            await pipeline.stop()
        got = (
            seen.results_frame()
            .filter(pl.col("key") != "sentinel")
            .group_by("key")
            .agg(pl.col("count").sum(), pl.col("sum").sum())
            .sort("key")
        )
        want = (
            fleet.expected_rows(steps)
            .group_by(pl.col("sensor_id").alias("key"))
            .agg(count=pl.len().cast(pl.Int64), sum=pl.col("value").sum())
            .sort("key")
        )
        assert got["key"].to_list() == want["key"].to_list()
        assert got["count"].to_list() == want["count"].to_list()
        assert np.allclose(got["sum"].to_numpy(), want["sum"].to_numpy(), rtol=1e-12)

    asyncio.run(scenario())


# -- kill -9 -----------------------------------------------------------------------------------


def _unique_messages(root: str, count: int, start_ms: int) -> list[tuple[str, bytes]]:
    """Messages whose single value is globally unique: each must arrive exactly once."""
    return [
        (
            f"{root}/sensors/s{i % 4}/d{i % 10}",
            orjson.dumps({"v": i, "ts": start_ms + i}),
        )
        for i in range(count)
    ]


def _write_unique_mapping(path: Path, root: str) -> None:
    path.write_text(
        f"""
name = "kill"
stream = "{STREAM}"
max_future_ms = false

[batching]
max_rows = 300
max_delay_ms = 50

[[routes]]
topic = "{root}/sensors/{{site}}/{{device}}"
format = "json-object"
fields = ["v"]
timestamp = {{ field = "ts", unit = "ms" }}
""",
        encoding="utf-8",
    )


def _start_adapter(
    broker: EmbeddedBroker, topics: Topics, mapping: Path, adapter_id: str, tmp: Path, n: int
) -> subprocess.Popen[str]:
    with (tmp / f"{adapter_id}-{n}.stderr").open("w") as stderr:
        return spawn_tied(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                "-v",
                "adapt",
                f"--mapping={mapping}",
                f"--id={adapter_id}",
                f"--spool-dir={tmp / adapter_id}",
                f"--broker=mqtt://127.0.0.1:{broker.port}",
                f"--topic-root={topics.root}",
                "--stats-interval=1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )


def _wait_subscribed(tmp: Path, names: list[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    for name in names:
        log = tmp / f"{name}.stderr"
        while "subscribed to" not in log.read_text(encoding="utf-8"):
            assert time.monotonic() < deadline, f"{name} did not subscribe:\n{log.read_text()}"
            time.sleep(0.05)


def test_kill_9_adapter_with_a_second_sharing_the_load_loses_and_repeats_nothing(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    mapping = tmp_path / "mapping.toml"
    _write_unique_mapping(mapping, topics.root)
    count = 12_000
    messages = _unique_messages(topics.root, count, 1_700_000_000_000)
    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        steady = _start_adapter(broker, topics, mapping, "ad-steady", tmp_path, 0)
        victim = _start_adapter(broker, topics, mapping, "ad-victim", tmp_path, 0)
        procs = [steady, victim]
        try:
            _wait_subscribed(tmp_path, ["ad-steady-0", "ad-victim-0"])
            publisher = DevicePublisher(broker.settings, rate=3_000)
            done = threading.Event()
            thread = threading.Thread(
                target=lambda: (publisher.run(iter(messages)), done.set()), daemon=True
            )
            thread.start()
            for incarnation in (1, 2):
                time.sleep(1.2)
                victim.kill()  # SIGKILL mid-stream: messages in flight, rows logged, seals
                victim.wait()
                time.sleep(0.3)
                victim = _start_adapter(broker, topics, mapping, "ad-victim", tmp_path, incarnation)
                procs.append(victim)
            thread.join(60)
            assert done.is_set(), "the devices could not publish everything"

            def values() -> np.ndarray:
                parts = [
                    np.concatenate(list(confirmer.snapshot(g).rows.values()))
                    for g in ("ad-steady", "ad-victim")
                    if confirmer.snapshot(g).rows
                ]
                return np.concatenate(parts) if parts else np.array([])

            deadline = time.monotonic() + 60
            while len(values()) < count and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)  # anything counted twice would show up now
        finally:
            for proc in procs:
                stop_process(proc)
        got = values()
        for gateway in ("ad-steady", "ad-victim"):
            snap = confirmer.snapshot(gateway)
            assert snap.mismatched == [], f"{gateway}: a seq was re-sent with other rows"
            assert sorted(snap.rows) == list(range(len(snap.rows))), f"{gateway}: seq gap"
        assert confirmer.snapshot("ad-steady").rows, "the steady adapter took no share"
        assert len(got) == count, f"{len(got)} values for {count} messages"
        assert np.array_equal(np.sort(got), np.arange(count, dtype=np.float64))


def test_sigterm_while_the_broker_is_down_exits_at_once_and_a_restart_loses_nothing(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    mapping = tmp_path / "mapping.toml"
    _write_unique_mapping(mapping, topics.root)
    first, second = 3_000, 2_000
    messages = _unique_messages(topics.root, first + second, 1_700_000_000_000)
    with Confirmer(broker.settings, topics, STREAM) as confirmer:

        def values() -> np.ndarray:
            rows = confirmer.snapshot("ad-stop").rows
            return np.concatenate(list(rows.values())) if rows else np.array([])

        def until_values(count: int) -> None:
            deadline = time.monotonic() + 60
            while len(values()) < count and time.monotonic() < deadline:
                time.sleep(0.1)

        adapter = _start_adapter(broker, topics, mapping, "ad-stop", tmp_path, 0)
        procs = [adapter]
        confirmer.holding = True  # the adapter's batches stay unconfirmed, in its spool
        try:
            _wait_subscribed(tmp_path, ["ad-stop-0"])
            sent = DevicePublisher(broker.settings, rate=3_000).run(iter(messages[:first]))
            assert sent.acknowledged == first
            until_values(first)  # every device message is in a batch the broker took
            # Past an autosave (dev profile: every 2 s) of the acknowledgements: a broker
            # killed before it would deliver the device messages again from its older state,
            # which the adapter takes as new ones (a broker limit, not the adapter's stop).
            time.sleep(3.0)
            broker.kill()
            time.sleep(1.0)  # the adapter has seen the connection go and is reconnecting
            signalled = time.monotonic()
            adapter.send_signal(signal.SIGTERM)
            code = adapter.wait(10)
            took = time.monotonic() - signalled
            print(f"the adapter stopped in {took:.2f} s with the broker down")
            log = (tmp_path / "ad-stop-0.stderr").read_text()
            assert code == 0, log[-3000:]
            assert took < 5.0, log[-3000:]
            assert "unconfirmed" in log, log[-3000:]
            assert "stay in the spool" in log, log[-3000:]
            broker.start()
            # The confirmer subscribed again before the adapter re-sends its spool (re-sends
            # published while no one subscribes to ingest reach nobody: seen in CI).
            assert confirmer.session.wait_connected(15), "the confirmer did not reconnect"
            adapter = _start_adapter(broker, topics, mapping, "ad-stop", tmp_path, 1)
            procs.append(adapter)
            _wait_subscribed(tmp_path, ["ad-stop-1"])
            # Confirms only now: the confirmer, reconnecting first, would otherwise confirm
            # what it got before the kill, and the restarted adapter would rightly drop its
            # spooled copies instead of re-sending them (seen in CI under parallel load).
            confirmer.holding = False
            sent = DevicePublisher(broker.settings, rate=3_000).run(iter(messages[first:]))
            assert sent.acknowledged == second
            until_values(first + second)
            time.sleep(1.0)  # anything counted twice would show up now
        finally:
            for proc in procs:
                stop_process(proc)
        snap = confirmer.snapshot("ad-stop")
        assert snap.mismatched == [], "a seq was re-sent with other rows"
        assert sorted(snap.rows) == list(range(len(snap.rows))), "seq gap"
        assert max(snap.deliveries.values()) >= 2, "the spooled batches were not sent again"
        got = values()
        assert len(got) == first + second, f"{len(got)} values for {first + second} messages"
        assert np.array_equal(np.sort(got), np.arange(first + second, dtype=np.float64))


# -- Sparkplug B -------------------------------------------------------------------------------


class _Capture:
    """Everything published on some filters, as the broker delivered it."""

    def __init__(self, broker: EmbeddedBroker, filters: list[str]) -> None:
        self.messages: list[Message] = []
        self.filters = filters
        self.session = ThreadedSession(
            broker.settings,
            unique_client_id("capture"),
            on_message=self.messages.append,
            on_connect=lambda s: [s.subscribe(f, qos=1) for f in self.filters],
        )

    def __enter__(self) -> _Capture:
        self.session.start()
        assert self.session.wait_connected(10)
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.stop()


def test_sparkplug_births_aliases_deaths_and_rebirth_requests(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    namespace = f"{topics.root}/spBv1.0"
    fleet = DeviceFleet("sparkplug", 6, prefix=namespace, nodes=2)
    steps = 25
    mapping = parse_mapping(
        {
            "name": "sparkplug",
            "stream": STREAM,
            "max_future_ms": False,
            "batching": {"max_rows": 200, "max_delay_ms": 100},
            "routes": [{"topic": namespace, "format": "sparkplug"}],
        }
    )
    spec = _spec("adapt-sparkplug")
    odd = f"{namespace}/other"  # a node that dies and then misbehaves
    trouble = [
        (f"{odd}/NBIRTH/nx", node_birth(fleet.ts(0), 0, 7)),
        (f"{odd}/DBIRTH/nx/dev0", device_message(0, fleet.ts(0), 1, 1.0, 1, birth=True)),
        (f"{odd}/DDATA/nx/dev0", device_message(0, fleet.ts(1), 9, 2.0, 2, birth=False)),  # gap
        (f"{odd}/NDEATH/nx", node_death(fleet.ts(2), 7)),
        (f"{odd}/DDATA/nx/dev0", device_message(0, fleet.ts(3), 10, 3.0, 3, birth=False)),
    ]

    async def scenario() -> None:
        pipeline = InProcessPipeline(
            spec, broker.settings, topics, workers=1, state_dir=tmp_path / "state"
        )
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            adapter = Adapter(AdapterConfig(mapping, "sp1", broker=broker.settings, topics=topics))
            task = asyncio.create_task(adapter.run())
            await asyncio.wait_for(adapter.ready.wait(), 10)
            publisher = DevicePublisher(broker.settings)
            messages = [*fleet.messages(0, steps), *trouble]
            report = await asyncio.to_thread(publisher.run, iter(messages))
            assert report.acknowledged == len(messages)
            want = fleet.count * steps * 2 + 2 + 2  # the fleet, and nx's birth and gap data
            await until(lambda: adapter.stats.rows >= want, 30, "every row sealed")
            await until(lambda: _confirmed(adapter), 30, "the pipeline to confirm")
            threshold = await pipeline.wait_closed_through(fleet.ts(steps - 1) - spec.lateness_ms)
            await asyncio.sleep(0.5)
            adapter.stop()
            await task
            await pipeline.stop()
        assert adapter.stats.rows == want
        assert adapter.stats.refused == {"data_before_birth": 1}
        assert adapter.stats.commands == 2
        rows = _oracle_rows(fleet.expected_rows(steps))
        expected, _ = expected_results(rows, spec)
        expected = expected.filter(pl.col("end") <= threshold)
        emitted = seen.results_frame().filter(
            (pl.col("end") <= threshold) & pl.col("key").str.starts_with(fleet.group)
        )
        assert_matches_oracle(emitted, expected, spec, scale_of(rows, spec), skip=("batches",))

    with _Capture(broker, [f"{namespace}/+/NCMD/+", topics.deadletter("sparkplug")]) as capture:
        asyncio.run(scenario())
        time.sleep(0.5)
    commands = [m for m in capture.messages if "/NCMD/" in m.topic]
    assert [m.topic for m in commands] == [f"{odd}/NCMD/nx"] * 2  # after the gap, after death
    for message in commands:
        payload = pb.Payload.FromString(message.payload)
        assert [(m.name, m.boolean_value) for m in payload.metrics] == [
            ("Node Control/Rebirth", True)
        ]
    letters = [m for m in capture.messages if m.topic == topics.deadletter("sparkplug")]
    assert [dict(m.user_properties)["reason"] for m in letters] == ["data_before_birth"]
    record = msgpack.unpackb(letters[0].payload)
    assert record["topic"] == f"{odd}/DDATA/nx/dev0"
    assert "before its NBIRTH" in record["error"]["message"]


def test_simulate_devices_exits_0_when_everything_was_acknowledged(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    for kind in ("json", "raw", "sparkplug"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                "simulate",
                f"--devices={kind}",
                "--count=4",
                "--rate=5",
                "--duration=1",
                "--embedded",
                "-q",
                f"--json={out}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        report = orjson.loads(out.read_bytes())
        assert report["sent"] == report["acknowledged"] == (20 if kind != "sparkplug" else 22)


class _NoAckSession(BatchedSession):
    """An adapter session whose PUBACKs never leave: a crash between the intake log and the
    acknowledgement, made deterministic."""

    def ack(self, message: Message) -> None:
        del message

    def ack_many(self, messages: Sequence[Message]) -> None:
        del messages


def test_redeliveries_after_a_crash_between_log_and_puback_count_once(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    path = tmp_path / "mapping.toml"
    _write_unique_mapping(path, topics.root)
    base = load_mapping(path)
    mapping = dataclasses.replace(
        base, batching=dataclasses.replace(base.batching, stall_ms=1_000, max_delay_ms=50)
    )
    config = AdapterConfig(
        mapping, "ad-crash", broker=broker.settings, topics=topics, spool_dir=tmp_path / "spool"
    )
    count = 50
    messages = _unique_messages(topics.root, count, 1_700_000_000_000)

    async def scenario(confirmer: Confirmer) -> tuple[Adapter, Adapter]:
        first = Adapter(config, session_factory=_NoAckSession)
        task = asyncio.create_task(first.run())
        await asyncio.wait_for(first.ready.wait(), 10)
        await asyncio.to_thread(DevicePublisher(broker.settings).run, iter(messages))
        # each read of the socket is one group: the 50 may come in more than one seal
        await until(lambda: first.stats.rows >= count, 20, "the first adapter to seal all")
        assert first.stats.rows == count  # logged, sealed, and never acknowledged
        task.cancel()  # gone without a PUBACK: the broker still holds every message
        with contextlib.suppress(asyncio.CancelledError):
            await task
        second = Adapter(config)
        task = asyncio.create_task(second.run())
        await until(lambda: second.stats.messages >= count, 20, "the redeliveries")
        await asyncio.sleep(1.0)
        second.stop()
        await task
        return first, second

    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        _, second = asyncio.run(scenario(confirmer))
        assert confirmer.wait_contiguous("ad-crash", 0, 10)
        time.sleep(0.5)
        snap = confirmer.snapshot("ad-crash")
    assert second.stats.redeliveries == count  # every one recognised...
    assert second.stats.rows == 0  # ...and none sealed again
    values = np.sort(np.concatenate(list(snap.rows.values())))
    assert np.array_equal(values, np.arange(count, dtype=np.float64))


class _ImpatientSession(AsyncSession):
    """A device-side session waiting 1 ms for a reply once connected instead of aiomqtt's 10 s:
    a loaded machine on which the backlog ahead of a SUBACK takes longer to read than the
    reply timeout (a resumed session's backlog of 3,000 messages takes far more than 1 ms to
    read, so the SUBACK always comes late). ``AsyncSession`` was the adapter's session when
    the defect was seen; ``BatchedSession`` has no fixed reply timeout."""

    async def __aenter__(self) -> _ImpatientSession:
        await super().__aenter__()
        self._client.timeout = 0.001
        return self


def test_a_resumed_adapter_drains_the_backlog_queued_ahead_of_its_suback(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    """The broker sends a returning persistent session its queued messages first, so the
    SUBACK of the adapter's SUBSCRIBE comes after them. Before the fix, a SUBACK later than the
    reply timeout ended the connection, the next one got the same backlog again and the
    adapter never got anywhere (seen at load ~25 with aiomqtt's 10 s)."""
    path = tmp_path / "mapping.toml"
    _write_unique_mapping(path, topics.root)
    config = AdapterConfig(
        load_mapping(path),
        "ad-backlog",
        broker=broker.settings,
        topics=topics,
        spool_dir=tmp_path / "spool",
    )
    count = 3_000
    messages = _unique_messages(topics.root, count, 1_700_000_000_000)

    async def join() -> None:  # the persistent session and its subscription, then away
        adapter = Adapter(config)
        task = asyncio.create_task(adapter.run())
        await asyncio.wait_for(adapter.ready.wait(), 10)
        adapter.stop()
        await task

    async def resume() -> Adapter:
        adapter = Adapter(config, session_factory=_ImpatientSession)
        task = asyncio.create_task(adapter.run())
        try:
            await until(lambda: adapter.stats.rows >= count, 60, "the backlog sealed")
            await asyncio.wait_for(adapter.ready.wait(), 10)  # and the SUBACK came
        finally:
            adapter.stop()
            await task
        return adapter

    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        asyncio.run(join())
        DevicePublisher(broker.settings).run(iter(messages))
        adapter = asyncio.run(resume())
        assert confirmer.wait_contiguous("ad-backlog", 0, 10)
        snap = confirmer.snapshot("ad-backlog")
    assert adapter.stats.rows == count
    values = np.sort(np.concatenate(list(snap.rows.values())))
    assert np.array_equal(values, np.arange(count, dtype=np.float64))


def test_a_device_resend_with_the_same_message_id_counts_once(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    mapping = parse_mapping(
        {
            "name": "ids",
            "stream": STREAM,
            "max_future_ms": False,
            "batching": {"max_delay_ms": 50},
            "routes": [
                {
                    "topic": f"{topics.root}/sensors/{{site}}/{{device}}",
                    "format": "json-object",
                    "fields": ["v"],
                    "message_id": "id",
                    "timestamp": {"field": "ts"},
                }
            ],
        }
    )
    topic = f"{topics.root}/sensors/s1/d1"
    messages = [
        (topic, b'{"id": 1, "v": 1, "ts": 1700000000000}'),
        (topic, b'{"id": 1, "v": 1, "ts": 1700000000000}'),  # the device's own re-send
        (topic, b'{"id": 2, "v": 1, "ts": 1700000000000}'),  # same reading, new message
        (f"{topics.root}/sensors/s1/d2", b'{"id": 1, "v": 5, "ts": 1700000000000}'),
    ]

    async def scenario() -> Adapter:
        adapter = Adapter(AdapterConfig(mapping, "ids", broker=broker.settings, topics=topics))
        task = asyncio.create_task(adapter.run())
        await asyncio.wait_for(adapter.ready.wait(), 10)
        await asyncio.to_thread(DevicePublisher(broker.settings).run, iter(messages))
        await until(lambda: adapter.stats.messages >= len(messages), 10, "messages")
        adapter.stop()
        await task
        return adapter

    adapter = asyncio.run(scenario())
    assert adapter.stats.duplicates == 1
    assert adapter.stats.rows == 3
