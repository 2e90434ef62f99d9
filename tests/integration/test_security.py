"""The secure profile on a real Mosquitto: who may publish and read what, and who may log in.

For every role, every topic of the pipeline is published to (allowed → PUBACK success,
forbidden → "not authorized" and nothing delivered) and subscribed to (allowed → delivered,
forbidden → silent). Mosquitto 2.0.11 grants every SUBSCRIBE and filters each delivery by the
read rules, so "a forbidden subscribe fails" is proven by what arrives: every reader is
subscribed to everything, all topics are published, then a barrier message each reader may
read; by the time the barrier arrives, anything else routed to the reader would have arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from shoal.broker import AsyncSession
from shoal.broker.access import BrokerUser, Role
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Message, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError
from shoal.gateway import Gateway, GatewayConfig
from shoal.processors.spec import parse_pipeline
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.topics import Topics
from tests.support.secure import secure_broker

GRANTS_FORBIDDEN_SUBSCRIBE = (
    "Mosquitto 2.0.11 grants a forbidden SUBSCRIBE and filters each delivery; shoal-mochi "
    "refuses it (0x87), which AsyncSession.subscribe reports as a BrokerError "
    "(docs/brokers.md, difference 6)"
)

pytestmark = pytest.mark.broker

P, Q = "default", "other"
ROOT = Topics(root=f"sec-{uuid.uuid4().hex[:8]}")
PASSWORD = "pw-" + uuid.uuid4().hex[:8]

ROLES = {
    "gw-1": Role.gateway(),
    "gw-2": Role.gateway(),
    "worker-p": Role.worker(P),
    "worker-q": Role.worker(Q),
    "combiner-p": Role.combiner(P),
    "combiner-q": Role.combiner(Q),
    "combiners": Role.combiner(None),
    "dash": Role.dashboard(),
    "dash-p": Role.dashboard(P),
    "ops": Role.admin(),
    "plane": Role.control(),
}

TOPICS = {
    "ingest_gw1": ROOT.ingest("s", "gw-1"),
    "ingest_gw2": ROOT.ingest("s", "gw-2"),
    "status_gw1": ROOT.gateway_status("gw-1"),
    "status_gw2": ROOT.gateway_status("gw-2"),
    "confirm_gw1": ROOT.confirm("gw-1", P, 0),
    "confirm_gw2": ROOT.confirm("gw-2", P, 0),
    "confirm_gw1_q": ROOT.confirm("gw-1", Q, 1),
    "partials_p": ROOT.partials(P, 0),
    "partials_q": ROOT.partials(Q, 0),
    "deadletter_p": ROOT.deadletter(P),
    "deadletter_q": ROOT.deadletter(Q),
    "late_p": ROOT.late(P),
    "results_p": ROOT.results(P),
    "results_p_msgpack": ROOT.results_encoded(P, "msgpack"),
    "results_p_key": ROOT.result_key(P, "sensor-1"),
    "results_q": ROOT.results(Q),
    "metrics_worker": ROOT.metrics("worker", "w-1"),
    "metrics_combiner": ROOT.metrics("combiner", f"{P}-0"),
    "metrics_scaler": ROOT.metrics("scaler", "s-1"),
    "control_combiners_p": ROOT.combiner_control(P),
    "control_combiners_q": ROOT.combiner_control(Q),
    "control_worker": ROOT.control("w-1"),
    "pipeline_document": ROOT.pipeline_document(P),
    "pipeline_request": ROOT.pipeline_request("c-1"),
    "pipeline_reply": ROOT.pipeline_reply("c-1"),
    "pool_member": ROOT.pool_combiner("c-1"),
    "outside_root": Topics(root="elsewhere").ingest("s", "gw-1"),
    "unrelated": "unrelated/topic",
}

METRICS = {"metrics_worker", "metrics_combiner", "metrics_scaler"}
CONTROL = {"control_combiners_p", "control_combiners_q", "control_worker"}
RESULTS = {"results_p", "results_p_msgpack", "results_p_key", "results_q"}
CONFIRMS = {"confirm_gw1", "confirm_gw2", "confirm_gw1_q"}
PIPELINES = {"pipeline_document", "pipeline_request", "pipeline_reply"}

WRITES = {
    "gw-1": {"ingest_gw1", "status_gw1"},
    "gw-2": {"ingest_gw2", "status_gw2"},
    "worker-p": {"partials_p", "deadletter_p", "metrics_worker", "control_worker"},
    "worker-q": {"partials_q", "deadletter_q", "metrics_worker", "control_worker"},
    "combiner-p": {
        "results_p",
        "results_p_msgpack",
        "results_p_key",
        "late_p",
        "confirm_gw1",
        "confirm_gw2",
        "metrics_combiner",
        "deadletter_p",
        "control_worker",  # the answer to a flush goes to the asker's control topic
    },
    "combiner-q": {
        *("results_q", "confirm_gw1_q", "metrics_combiner", "deadletter_q", "control_worker"),
    },
    "combiners": RESULTS
    | CONFIRMS
    | {"late_p", "metrics_combiner", "deadletter_p", "deadletter_q", "pool_member"}
    | {"control_worker"},
    "dash": set(),
    "dash-p": set(),
    "ops": METRICS | CONTROL | {"pipeline_request"},
    "plane": {"pipeline_document", "pipeline_reply", "control_worker"},
}

READS = {
    "gw-1": {"confirm_gw1", "confirm_gw1_q"},
    "gw-2": {"confirm_gw2"},
    "worker-p": {"ingest_gw1", "ingest_gw2", "control_worker"},
    "worker-q": {"ingest_gw1", "ingest_gw2", "control_worker"},
    "combiner-p": {"partials_p", "status_gw1", "status_gw2", "control_combiners_p"},
    "combiner-q": {"partials_q", "status_gw1", "status_gw2", "control_combiners_q"},
    "combiners": {"partials_p", "partials_q", "status_gw1", "status_gw2", "pipeline_document"}
    | {"control_combiners_p", "control_combiners_q", "pool_member", "control_worker"},
    # Dashboards (shoal view) also read health: heartbeats, gateway statuses, late rows,
    # dead letters and pipeline documents, of their pipeline where the topic names one.
    "dash": RESULTS
    | METRICS
    | {"status_gw1", "status_gw2", "late_p", "pipeline_document"}
    | {"deadletter_p", "deadletter_q"},
    "dash-p": RESULTS - {"results_q"}
    | METRICS
    | {"status_gw1", "status_gw2", "late_p", "deadletter_p", "pipeline_document"},
    "ops": {"status_gw1", "status_gw2", "late_p", "deadletter_p", "deadletter_q"}
    | CONFIRMS
    | RESULTS
    | METRICS
    | CONTROL
    | PIPELINES
    | {"pool_member"},
    "plane": {"pipeline_request", "pipeline_document", "control_worker"},
}


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    with secure_broker(tmp_path_factory.mktemp("secure"), ROLES, PASSWORD, ROOT) as broker:
        yield broker


def as_user(settings: BrokerSettings, name: str, password: str = PASSWORD) -> BrokerSettings:
    return settings.with_credentials(name, password)


async def _try_connect(settings: BrokerSettings) -> None:
    async with AsyncSession(settings, unique_client_id("login")):
        pass


# -- logging in ---------------------------------------------------------------------------------


def test_anonymous_unknown_users_and_wrong_passwords_are_refused(secure: EmbeddedBroker) -> None:
    for settings in (
        secure.settings,  # anonymous
        as_user(secure.settings, "nobody"),
        as_user(secure.settings, "gw-1", "wrong"),
        as_user(secure.settings, "gw-1", ""),
        as_user(secure.tls_settings, "gw-1", "wrong"),
    ):
        with pytest.raises(BrokerError, match="cannot connect"):
            asyncio.run(_try_connect(settings))
    asyncio.run(_try_connect(as_user(secure.settings, "gw-1")))
    stored = secure.password_path.read_text()
    assert "gw-1:" in stored
    assert PASSWORD not in stored  # hashed by mosquitto_passwd


# -- publishing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("user", sorted(ROLES))
def test_each_role_may_publish_exactly_its_topics(secure: EmbeddedBroker, user: str) -> None:
    async def scenario() -> dict[str, str]:
        outcome = {}
        async with AsyncSession(as_user(secure.settings, user), unique_client_id(user)) as s:
            for name, topic in TOPICS.items():
                try:
                    await s.publish(topic, b"probe")
                    outcome[name] = "ok"
                except BrokerError as exc:
                    outcome[name] = str(exc)
            # Refused publishes do not cost the connection (see broker/secure.conf).
            await s.publish(ROOT.metrics("nobody", "x"), b"", qos=0)
        return outcome

    outcome = asyncio.run(asyncio.wait_for(scenario(), 30))
    allowed = {name for name, result in outcome.items() if result == "ok"}
    assert allowed == WRITES[user]
    refusals = {result for result in outcome.values() if result != "ok"}
    assert refusals <= {"broker refused a publish: Not authorized"}


def test_sys_topics_refuse_publishes_from_everyone(secure: EmbeddedBroker) -> None:
    async def scenario() -> None:
        async with AsyncSession(as_user(secure.settings, "ops"), unique_client_id("ops")) as s:
            with pytest.raises(BrokerError, match="Not authorized"):
                await s.publish("$SYS/broker/uptime", b"0")

    asyncio.run(asyncio.wait_for(scenario(), 10))


# -- reading ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _readers(
    settings: BrokerSettings, users: list[str], filters: list[str]
) -> AsyncIterator[dict[str, list[Message]]]:
    inboxes: dict[str, list[Message]] = {u: [] for u in users}
    sessions = [AsyncSession(as_user(settings, u), unique_client_id(u)) for u in users]
    tasks = []
    async with contextlib.AsyncExitStack() as stack:
        for user, session in zip(users, sessions, strict=True):
            await stack.enter_async_context(session)
            await session.subscribe(filters, qos=1)  # always granted by Mosquitto 2.0.11

            async def read(
                session: AsyncSession = session, inbox: list[Message] = inboxes[user]
            ) -> None:
                async for message in session.messages():
                    inbox.append(message)

            tasks.append(asyncio.create_task(read()))
        try:
            yield inboxes
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _publish_as(settings: BrokerSettings, user: str, items: list[tuple[str, bytes]]) -> None:
    async with AsyncSession(as_user(settings, user), unique_client_id(user)) as session:
        await session.wait_published([session.publish_started(t, p) for t, p in items])


def _writer_of(name: str) -> str:
    return next(user for user, names in sorted(WRITES.items()) if name in names)


@pytest.mark.broker_quirk(
    "mosquitto",
    reason=GRANTS_FORBIDDEN_SUBSCRIBE,
)
def test_each_role_reads_exactly_its_topics(secure: EmbeddedBroker) -> None:
    """Everyone subscribes to everything; each receives only what its role may read."""
    published = {name for name in TOPICS if any(name in w for w in WRITES.values())}
    by_writer: dict[str, list[tuple[str, bytes]]] = {}
    for name in sorted(published):
        by_writer.setdefault(_writer_of(name), []).append((TOPICS[name], name.encode()))

    async def scenario() -> dict[str, set[str]]:
        filters = ["#", f"{ROOT.root}/#", Topics.shared(P, ROOT.ingest_filter("s"))]
        async with _readers(secure.settings, sorted(ROLES), filters) as inboxes:
            for writer, items in by_writer.items():
                await _publish_as(secure.settings, writer, items)
            # Every probe above has its PUBACK, so it sits in each reader's queue ahead of
            # the barrier published now to a topic that reader may read.
            barriers: dict[str, list[tuple[str, bytes]]] = {}
            for reader in ROLES:
                topic = TOPICS[sorted(READS[reader])[0]]
                barriers.setdefault(_writer_of(sorted(READS[reader])[0]), []).append(
                    (topic, f"barrier:{reader}".encode())
                )
            for writer, items in barriers.items():
                await _publish_as(secure.settings, writer, items)
            for reader, inbox in inboxes.items():
                marker = f"barrier:{reader}".encode()
                await until(
                    lambda inbox=inbox, marker=marker: any(m.payload == marker for m in inbox)
                )
            return {
                reader: {m.payload.decode() for m in inbox if not m.payload.startswith(b"barrier")}
                for reader, inbox in inboxes.items()
            }

    received = asyncio.run(asyncio.wait_for(scenario(), 30))
    for reader in ROLES:
        assert received[reader] == READS[reader] & published, reader


def test_retained_messages_are_filtered_too(secure: EmbeddedBroker) -> None:
    """A retained confirmation reaches its gateway only, not another gateway or a dashboard."""
    confirm = ROOT.confirm("gw-1", P, 3)

    async def scenario() -> dict[str, list[bytes]]:
        async with AsyncSession(as_user(secure.settings, "combiner-p"), unique_client_id("c")) as c:
            await c.publish(confirm, b"retained-confirm", retain=True)
            await c.publish(ROOT.results(P), b"retained-result", retain=True)
        got: dict[str, list[bytes]] = {}
        for user in ("gw-1", "gw-2", "dash", "worker-p"):
            async with AsyncSession(as_user(secure.settings, user), unique_client_id(user)) as s:
                await s.subscribe([f"{ROOT.root}/#"])
                got[user] = []
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.7):
                        async for message in s.messages():
                            assert message.retain
                            got[user].append(message.payload)
        async with AsyncSession(as_user(secure.settings, "combiner-p"), unique_client_id("c")) as c:
            await c.publish(confirm, b"", retain=True)  # clear them again
            await c.publish(ROOT.results(P), b"", retain=True)
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert got["gw-1"] == [b"retained-confirm"]
    assert got["dash"] == [b"retained-result"]
    assert got["gw-2"] == []
    assert got["worker-p"] == []


@pytest.mark.broker_quirk(
    "mosquitto",
    reason=GRANTS_FORBIDDEN_SUBSCRIBE,
)
def test_only_admin_reads_sys(secure: EmbeddedBroker) -> None:
    async def scenario() -> dict[str, int]:
        counts = {"ops": 0, "dash": 0, "gw-1": 0}
        sessions = [AsyncSession(as_user(secure.settings, u), unique_client_id(u)) for u in counts]
        async with contextlib.AsyncExitStack() as stack:
            for session in sessions:
                await stack.enter_async_context(session)
                await session.subscribe(["$SYS/#"], qos=0)

            async def count(user: str, session: AsyncSession) -> None:
                async for _ in session.messages():
                    counts[user] += 1

            tasks = [
                asyncio.create_task(count(u, s)) for u, s in zip(counts, sessions, strict=True)
            ]
            await until(lambda: counts["ops"] >= 20, 20)  # $SYS comes every 2 s (sys_interval)
            await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return counts

    counts = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert counts["dash"] == 0
    assert counts["gw-1"] == 0


def test_users_reload_without_restart(secure: EmbeddedBroker, tmp_path: Path) -> None:
    """``set_users`` (SIGHUP) admits a new dashboard at once; the others keep working."""
    before = secure.pid
    newcomer = BrokerUser("grafana", "pw-new", Role.dashboard(P))
    with pytest.raises(BrokerError, match="cannot connect"):
        asyncio.run(_try_connect(as_user(secure.settings, "grafana", "pw-new")))
    original = list(secure.users)
    try:
        secure.set_users([*original, newcomer])
        deadline = asyncio.run(_eventually_connects(as_user(secure.settings, "grafana", "pw-new")))
        assert deadline
        assert secure.pid == before
        asyncio.run(_try_connect(as_user(secure.settings, "gw-1")))
    finally:
        secure.set_users(original)


async def _eventually_connects(settings: BrokerSettings, timeout_s: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            await _try_connect(settings)
        except BrokerError:
            await asyncio.sleep(0.1)
        else:
            return True
    return False


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


# -- shared subscriptions -----------------------------------------------------------------------

SHARE_SPEC = parse_pipeline(
    {
        "name": P,
        "windows": [{"kind": "tumbling", "size_ms": 1_000}],
        "aggregates": ["count"],
        "lateness_ms": 0,
        "idle_timeout_ms": 300,
        "checkpoint_interval_ms": 100,
    }
)


@pytest.mark.broker_quirk(
    "mosquitto",
    reason=GRANTS_FORBIDDEN_SUBSCRIBE,
)
def test_a_share_member_without_read_access_delays_but_loses_nothing(
    secure: EmbeddedBroker, tmp_path: Path
) -> None:
    """A dashboard joins the workers' shared subscription. Mosquitto still deals it its turn
    and then drops those messages (no read access): the gateway's re-sends get every batch
    through the real worker, the dashboard sees none of them, and the results are exact."""
    plain = secure.settings
    worker = Worker(
        WorkerConfig(SHARE_SPEC, as_user(plain, "worker-p"), ROOT, worker_id="share-worker")
    )
    combiner = CombinerRuntime(
        CombinerConfig(
            SHARE_SPEC, 0, as_user(plain, "combiner-p"), ROOT, state_dir=tmp_path / "c", tick_ms=50
        )
    )
    rows_per_batch, batches = 50, 8
    base = int(time.time() * 1000) // 1000 * 1000 - 60_000

    async def scenario() -> tuple[int, list[Message], int]:
        tasks = [asyncio.create_task(combiner.run()), asyncio.create_task(worker.run())]
        rogue = AsyncSession(as_user(plain, "dash"), unique_client_id("rogue"))
        async with rogue, AsyncSession(as_user(plain, "dash"), unique_client_id("reader")) as dash:
            await rogue.subscribe([Topics.shared(P, ROOT.under_root(f)) for f in SHARE_SPEC.inputs])
            await dash.subscribe([ROOT.results(P)])
            await asyncio.sleep(0.5)
            gateway = Gateway(
                GatewayConfig(
                    "gw-1",
                    stream="s",
                    broker=as_user(plain, "gw-1"),
                    topics=ROOT,
                    batch_size=rows_per_batch,
                    spool_dir=tmp_path / "spool",
                    resend_after_ms=300,
                )
            ).start()
            try:
                n = rows_per_batch * batches
                ts = base + np.arange(n, dtype=np.int64) * 20
                gateway.add_many(np.array(["k"] * n), ts, np.ones(n))
                gateway.flush()
                assert await asyncio.to_thread(gateway.wait_confirmed, 40), gateway.stats()
                resends = gateway.stats().resends
            finally:
                await asyncio.to_thread(gateway.close, 1)
            async with AsyncSession(as_user(plain, "ops"), unique_client_id("ops")) as ops:
                await ops.publish(ROOT.combiner_control(P), orjson.dumps({"cmd": "flush"}))
            counted = 0
            async with asyncio.timeout(15):
                async for message in dash.messages():
                    if message.retain:
                        continue  # another test's leftover, not this pipeline run's result
                    counted += orjson.loads(message.payload)["rows"]
                    if counted >= n:
                        break
            swallowed: list[Message] = []
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.3):
                    async for message in rogue.messages():
                        swallowed.append(message)
        worker.stop()
        combiner.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        return counted, swallowed, resends

    counted, swallowed, resends = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert counted == rows_per_batch * batches
    assert swallowed == []
    assert resends > 0  # the rogue member did take turns: their batches came back by re-send
