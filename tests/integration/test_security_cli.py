"""``shoal broker --profile secure`` as an operator runs it: users file, TLS, SIGHUP reload."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import ssl
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from websockets.asyncio.client import connect as ws_connect

from shoal._processes import shoal_argv
from shoal._spawn import spawn_tied
from shoal.broker import AsyncSession
from shoal.broker.session import unique_client_id
from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import BrokerError
from tests.support.processes import read_until

pytestmark = pytest.mark.broker

USERS = """
[[users]]
name = "gw-7"
role = "gateway"
password_env = "TEST_GW7_PASSWORD"

[[users]]
name = "ops"
role = "admin"
password_file = "ops.pw"
"""

DASHBOARD = """
[[users]]
name = "grafana"
role = "dashboard:default"
password = "dash-pw"
"""


async def _connect(settings: BrokerSettings) -> None:
    async with AsyncSession(settings, unique_client_id("cli")) as session:
        await session.publish("shoal/metrics/probe/x", b"", qos=0)


def _refused(settings: BrokerSettings) -> bool:
    try:
        asyncio.run(asyncio.wait_for(_connect(settings), 10))
    except BrokerError:
        return True
    return False


def _ws_connack(url: str, ca: Path, user: str, password: str) -> bytes:
    """The CONNACK a browser logging in as ``user`` gets over the WebSocket listener."""

    def sized(text: str) -> bytes:
        return len(text).to_bytes(2, "big") + text.encode()

    rest = sized("MQTT") + bytes([5, 0xC2, 0, 60, 0]) + sized("web") + sized(user)
    rest += sized(password)
    connect = bytes([0x10, len(rest)]) + rest

    async def exchange() -> bytes:
        context = ssl.create_default_context(cafile=str(ca))
        async with ws_connect(url, subprotocols=["mqtt"], ssl=context) as ws:
            await ws.send(connect)
            return bytes(await ws.recv())

    return asyncio.run(exchange())


def test_secure_broker_command(tmp_path: Path) -> None:
    users_file = tmp_path / "users.toml"
    users_file.write_text(USERS)
    (tmp_path / "ops.pw").write_text("ops-pw\n")
    data_dir = tmp_path / "broker"
    env = {**os.environ, "TEST_GW7_PASSWORD": "gw7-pw", "PYTHONUNBUFFERED": "1"}
    argv = shoal_argv(
        "broker",
        "--profile",
        "secure",
        "--port",
        "0",
        "--tls-port",
        "0",
        "--data-dir",
        str(data_dir),
        "--users-file",
        str(users_file),
    )
    process = spawn_tied(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        plain = read_until(process, r"listening on mqtt://")
        tls = read_until(process, r"TLS\s+mqtts://")
        ws_url = re.findall(r"(wss://\S+)", read_until(process, r"WebSockets\s+wss://"))[0]
        port = int(re.findall(r":(\d+)\s*$", plain)[0])
        tls_port = int(re.findall(r"mqtts://[^:]+:(\d+)", tls)[0])
        ca = Path(re.findall(r"clients trust (\S+)\)", tls)[0])
        settings = BrokerSettings(port=port)
        assert _refused(settings)  # anonymous
        asyncio.run(_connect(settings.with_credentials("gw-7", "gw7-pw")))
        asyncio.run(_connect(settings.with_credentials("ops", "ops-pw")))
        over_tls = BrokerSettings(port=tls_port, tls=TlsSettings(ca_file=ca))
        asyncio.run(_connect(over_tls.with_credentials("gw-7", "gw7-pw")))
        assert _refused(settings.with_credentials("grafana", "dash-pw"))

        users_file.write_text(USERS + DASHBOARD)
        process.send_signal(signal.SIGHUP)
        read_until(process, r"reloaded 3 user")
        deadline = time.monotonic() + 5  # mosquitto reloads on its own SIGHUP, soon after
        while _refused(settings.with_credentials("grafana", "dash-pw")):
            assert time.monotonic() < deadline, "the new user was not admitted"
            time.sleep(0.1)
        # Browsers (shoal view): TLS, the reloaded dashboard user only; others get "not
        # authorized" (0x87) from the bridge even with the right password.
        assert _ws_connack(ws_url, ca, "grafana", "dash-pw")[3] == 0x00
        # A wrong password is the broker's own refusal: "not authorized" (0x87) from
        # Mosquitto, "bad user name or password" (0x86) from Mochi (docs/brokers.md).
        assert _ws_connack(ws_url, ca, "grafana", "wrong")[3] in {0x86, 0x87}
        assert _ws_connack(ws_url, ca, "ops", "ops-pw")[3] == 0x87

        brokers = {"mosquitto", "shoal-mochi"}  # whichever SHOAL_TEST_BROKER chose
        children = psutil.Process(process.pid).children()
        (broker,) = [p for p in children if p.name() in brokers]
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
        assert not broker.is_running() or broker.status() == psutil.STATUS_ZOMBIE
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        if process.stdout is not None:
            process.stdout.close()
