"""TLS on the secure profile, with a throwaway CA made by the test, and a whole pipeline run
with least privilege: each component logs in with its own role, the gateway over TLS.

Both MQTT sessions (asyncio for components, threaded for gateways) must use the TLS
settings: a broker certificate from another CA, or for another host name, is refused; with
``require_certificate``, a client without a certificate, or with one from another CA, is
refused too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from shoal.broker import AsyncSession, BatchedSession, ThreadedSession
from shoal.broker.access import BrokerUser, Role
from shoal.broker.certs import CertFiles, CertificateAuthority, make_ca, make_certificate
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.probe import probe_broker
from shoal.broker.profiles import ServerTls
from shoal.broker.session import SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import BrokerError
from shoal.gateway import Gateway, GatewayConfig
from shoal.processors.spec import parse_pipeline
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas.topics import Topics

pytestmark = pytest.mark.broker

PASSWORD = "tls-pw"


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: CertFiles
    client: CertFiles
    rogue_ca: CertificateAuthority
    rogue_client: CertFiles
    wrong_host_server: CertFiles


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca", "shoal test CA")
    rogue = make_ca(root / "rogue", "rogue CA")
    return Pki(
        ca=ca,
        server=make_certificate(ca, root / "server", "broker"),
        client=make_certificate(ca, root / "client", "gw-1", hosts=(), client=True),
        rogue_ca=rogue,
        rogue_client=make_certificate(rogue, root / "rogue-client", "gw-1", hosts=(), client=True),
        wrong_host_server=make_certificate(ca, root / "other", "other", hosts=("other.example",)),
    )


def _users() -> list[BrokerUser]:
    return [
        BrokerUser("gw-1", PASSWORD, Role.gateway()),
        BrokerUser("worker", PASSWORD, Role.worker("tls")),
        BrokerUser("combiner", PASSWORD, Role.combiner("tls")),
        BrokerUser("dash", PASSWORD, Role.dashboard("tls")),
        BrokerUser("ops", PASSWORD, Role.admin()),
    ]


@pytest.fixture(scope="module")
def tls_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    broker = EmbeddedBroker(
        "secure",
        data_dir=tmp_path_factory.mktemp("tls-broker"),
        users=_users(),
        tls=ServerTls(pki.server.cert_file, pki.server.key_file, pki.ca.cert_file),
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.close()


def _tls(broker: EmbeddedBroker, **tls: Path | bool | None) -> BrokerSettings:
    return dataclasses.replace(
        broker.tls_settings, tls=TlsSettings(**tls), username="gw-1", password=PASSWORD
    )


async def _round_trip(
    settings: BrokerSettings, topic: str, factory: SessionFactory = AsyncSession
) -> bytes:
    async with factory(settings, unique_client_id("tls")) as session:
        await session.subscribe([topic])
        await session.publish(topic, b"over tls")
        async for message in session.messages():
            return message.payload
    raise AssertionError("unreachable")


def _threaded_connects(settings: BrokerSettings, timeout_s: float) -> bool:
    session = ThreadedSession(settings, unique_client_id("tls-thread"))
    session.start()
    try:
        return session.wait_connected(timeout_s)
    finally:
        session.stop()
        # paho leaves the socket of a failed TLS handshake to the garbage collector; collect
        # it here, inside the test that expects the failure (see ``refusals``).
        gc.collect()


def refusals(test: Callable[..., None]) -> Callable[..., None]:
    """Tests of refused handshakes: paho's leaked sockets are expected there."""
    test = pytest.mark.filterwarnings("ignore::ResourceWarning")(test)
    return pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)


def test_tls_with_the_right_ca_works_for_both_sessions(
    tls_broker: EmbeddedBroker, pki: Pki
) -> None:
    settings = _tls(tls_broker, ca_file=pki.ca.cert_file)
    assert settings.url.startswith("mqtts://")
    # A worker may both write and read its control topic: a round trip over TLS.
    worker = settings.with_credentials("worker", PASSWORD)
    topic = Topics().control("w-tls")
    for factory in (AsyncSession, BatchedSession):  # BatchedSession: the adapter's (mqtt5)
        got = asyncio.run(asyncio.wait_for(_round_trip(worker, topic, factory), 10))
        assert got == b"over tls", factory
    assert _threaded_connects(settings, 5.0)


@refusals
def test_a_broker_certificate_from_another_ca_is_refused(
    tls_broker: EmbeddedBroker, pki: Pki
) -> None:
    rogue = _tls(tls_broker, ca_file=pki.rogue_ca.cert_file)
    with pytest.raises(BrokerError, match="cannot connect"):
        asyncio.run(asyncio.wait_for(_connect(rogue), 10))
    with pytest.raises(BrokerError, match="cannot connect"):
        asyncio.run(asyncio.wait_for(_connect(rogue, BatchedSession), 10))
    assert not _threaded_connects(rogue, 2.0)
    # The system trust store does not know our throwaway CA either.
    system = _tls(tls_broker, ca_file=None)
    with pytest.raises(BrokerError, match="cannot connect"):
        asyncio.run(asyncio.wait_for(_connect(system), 10))


def test_plain_mqtt_to_the_tls_port_is_refused(tls_broker: EmbeddedBroker) -> None:
    # A plain CONNECT gets no CONNACK there (the plain listener answers at once).
    assert not probe_broker(tls_broker.settings_host, tls_broker.tls_port, 1.0)
    assert probe_broker(tls_broker.settings_host, tls_broker.port, 1.0)


async def _connect(settings: BrokerSettings, factory: SessionFactory = AsyncSession) -> None:
    async with factory(settings, unique_client_id("tls")):
        pass


@refusals
def test_host_name_is_verified(pki: Pki, tmp_path: Path) -> None:
    files = pki.wrong_host_server
    tls = ServerTls(files.cert_file, files.key_file, pki.ca.cert_file)
    with EmbeddedBroker("secure", data_dir=tmp_path, users=_users(), tls=tls) as broker:
        strict = _tls(broker, ca_file=pki.ca.cert_file)
        for factory in (AsyncSession, BatchedSession):
            with pytest.raises(BrokerError, match="cannot connect"):
                asyncio.run(asyncio.wait_for(_connect(strict, factory), 10))
        assert not _threaded_connects(strict, 2.0)
        lax = _tls(broker, ca_file=pki.ca.cert_file, verify_hostname=False)
        asyncio.run(asyncio.wait_for(_connect(lax), 10))
        asyncio.run(asyncio.wait_for(_connect(lax, BatchedSession), 10))
        assert _threaded_connects(lax, 5.0)


@refusals
def test_client_certificates_when_required(pki: Pki, tmp_path: Path) -> None:
    tls = ServerTls(
        pki.server.cert_file, pki.server.key_file, pki.ca.cert_file, require_client_certificate=True
    )
    with EmbeddedBroker("secure", data_dir=tmp_path, users=_users(), tls=tls) as broker:
        good = _tls(
            broker,
            ca_file=pki.ca.cert_file,
            cert_file=pki.client.cert_file,
            key_file=pki.client.key_file,
        )
        asyncio.run(asyncio.wait_for(_connect(good), 10))
        assert _threaded_connects(good, 5.0)
        for bad in (
            _tls(broker, ca_file=pki.ca.cert_file),  # no certificate
            _tls(
                broker,
                ca_file=pki.ca.cert_file,
                cert_file=pki.rogue_client.cert_file,
                key_file=pki.rogue_client.key_file,
            ),
        ):
            assert not _threaded_connects(bad, 2.0)
        # With TLS 1.3 the broker's "certificate required" alert comes after the handshake;
        # the asyncio session notices at its connect timeout (aiomqtt's, 10 s).
        with pytest.raises(BrokerError, match="cannot connect"):
            asyncio.run(asyncio.wait_for(_connect(_tls(broker, ca_file=pki.ca.cert_file)), 30))
        # A certificate does not replace the password.
        with pytest.raises(BrokerError, match="cannot connect"):
            asyncio.run(asyncio.wait_for(_connect(dataclasses.replace(good, password="no")), 10))


# -- the whole pipeline with least privilege ------------------------------------------------------

SPEC = parse_pipeline(
    {
        "name": "tls",
        "windows": [{"kind": "tumbling", "size_ms": 1_000}],
        "aggregates": ["count", "sum"],
        "lateness_ms": 0,
        "idle_timeout_ms": 500,
        "checkpoint_interval_ms": 100,
        "partitions": 2,
    }
)


def test_pipeline_with_least_privilege_and_a_gateway_over_tls(
    tls_broker: EmbeddedBroker, pki: Pki, tmp_path: Path
) -> None:
    """Gateway (TLS) → worker → combiners → results, every component with its own role."""
    topics = Topics(root="")
    plain = tls_broker.settings
    worker = Worker(
        WorkerConfig(SPEC, plain.with_credentials("worker", PASSWORD), topics, heartbeat_ms=200)
    )
    combiners = [
        CombinerRuntime(
            CombinerConfig(
                SPEC,
                p,
                plain.with_credentials("combiner", PASSWORD),
                topics,
                state_dir=tmp_path / f"p{p}",
                tick_ms=50,
            )
        )
        for p in range(SPEC.partitions)
    ]
    gateway_settings = _tls(tls_broker, ca_file=pki.ca.cert_file)
    base = int(time.time() * 1000) // 1000 * 1000 - 10_000
    n = 600

    async def scenario() -> int:
        tasks = [asyncio.create_task(c.run()) for c in combiners]
        tasks.append(asyncio.create_task(worker.run()))
        counted = 0
        async with AsyncSession(
            plain.with_credentials("dash", PASSWORD), unique_client_id("dash")
        ) as dash:
            await dash.subscribe([topics.results(SPEC.name)])
            await asyncio.sleep(0.5)
            gateway = Gateway(
                GatewayConfig(
                    "gw-1",
                    stream="plant",
                    broker=gateway_settings,
                    topics=topics,
                    batch_size=100,
                    spool_dir=tmp_path / "spool",
                    resend_after_ms=1_000,
                )
            ).start()
            try:
                ids = np.array([f"s{i % 7}" for i in range(n)])
                ts = base + np.arange(n, dtype=np.int64) * 10
                gateway.add_many(ids, ts, np.ones(n))
                gateway.flush()
                assert await asyncio.to_thread(gateway.wait_confirmed, 30), gateway.stats()
            finally:
                await asyncio.to_thread(gateway.close, 1)
            # The operator closes the last, still open, window.
            async with AsyncSession(
                plain.with_credentials("ops", PASSWORD), unique_client_id("ops")
            ) as ops:
                await ops.publish(
                    topics.combiner_control(SPEC.name), orjson.dumps({"cmd": "flush"})
                )
            try:
                async with asyncio.timeout(20):
                    async for message in dash.messages():
                        counted += orjson.loads(message.payload)["rows"]
                        if counted >= n:
                            break
            finally:
                for component in (worker, *combiners):
                    component.stop()
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        return counted

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == n
