"""``shoal view`` as a command: the page, its vendored libraries, and its bridge to the broker."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect

from shoal._spawn import spawn_tied
from shoal.broker._mosquitto import mosquitto_binary
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.websocket import mosquitto_has_websockets

CONNECT_V311 = b"\x10\x0f\x00\x04MQTT\x04\x02\x00\x3c\x00\x03web"  # client id "web"
CONNACK_OK = b"\x20\x02\x00\x00"


async def mqtt_connect(url: str) -> bytes:
    async with connect(url, subprotocols=["mqtt"]) as ws:
        assert ws.subprotocol == "mqtt"
        await ws.send(CONNECT_V311)
        answer = await ws.recv()
        assert isinstance(answer, bytes)
        return answer


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, b""


@pytest.fixture
def view(broker: EmbeddedBroker) -> Iterator[str]:
    process = spawn_tied(
        [
            sys.executable,
            "-m",
            "shoal.cli",
            "view",
            "--port",
            "0",
            "--broker",
            broker.settings.url,
            "--topic-root",
            "site-7",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"(http://\S+/)", line)
        assert match, line
        yield match.group(1)
    finally:
        process.terminate()
        code = process.wait(10)
        assert process.stdout is not None
        process.stdout.close()
        assert code == 0


def test_shoal_view_serves_the_page_offline_and_bridges_to_the_broker(view: str) -> None:
    status, index = get(view)
    assert status == 200
    html = index.decode()
    # Offline at the edge: every script and style sheet is served from here.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    for asset in re.findall(r"""(?:src|href)="([^"]+)\"""", html):
        code, body = get(view + asset)
        assert code == 200, asset
        assert len(body) > 500, asset
    assert get(view + "vendor/")[0] == 404  # no directory listings
    assert get(view + "nothing.js")[0] == 404
    config = json.loads(get(view + "config.json")[1])
    assert config["root"] == "site-7"
    assert config["login"] is False
    assert config["ws_url"].startswith("ws://127.0.0.1:")
    # The bridge started by `shoal view` reaches the broker: the broker's own CONNACK.
    assert asyncio.run(mqtt_connect(config["ws_url"])) == CONNACK_OK


def test_the_embedded_broker_serves_websockets_natively_or_through_the_bridge(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    native = mosquitto_has_websockets(mosquitto_binary())
    with EmbeddedBroker("dev", data_dir=tmp_path_factory.mktemp("ws"), websockets=True) as broker:
        config = broker.config_path.read_text()
        assert bool(re.search(r"(?m)^protocol websockets$", config)) is native
        assert broker.ws_bridged is not native
        assert asyncio.run(mqtt_connect(broker.ws_url)) == CONNACK_OK
        broker.restart()  # the bridge outlives mosquitto
        assert asyncio.run(mqtt_connect(broker.ws_url)) == CONNACK_OK
