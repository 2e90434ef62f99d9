"""Pins the one aiomqtt private ``AsyncSession`` uses (``paho_client_of``; aiomqtt#345, #191).

No broker: the clients are built, not connected, and paho's callbacks are called as its
network loop would call them. If an aiomqtt upgrade moves or rewires its paho client, these
fail before any session does.
"""

from __future__ import annotations

import asyncio
import inspect

import aiomqtt
import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from shoal.broker._aio import AsyncSession, paho_client_of
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError


def test_it_is_the_paho_client_aiomqtt_drives_with_the_callbacks_we_chain() -> None:
    async def check() -> None:
        client = aiomqtt.Client(
            "127.0.0.1", 1, identifier="pin", protocol=aiomqtt.ProtocolVersion.V5
        )
        inner = paho_client_of(client)
        assert isinstance(inner, paho.Client)
        assert inner._client_id == b"pin"
        # AsyncSession calls these after its own hooks, with paho's VERSION2 arguments.
        for name in ("on_connect", "on_publish"):
            assert len(inspect.signature(getattr(inner, name)).parameters) == 5, name
        inner.manual_ack_set(True)
        assert inner._manual_ack is True  # paho reads it before it PUBACKs
        assert list(inspect.signature(inner.ack).parameters) == ["mid", "qos"]

    asyncio.run(check())


def test_connack_properties_and_puback_reason_codes_reach_the_session() -> None:
    async def check() -> None:
        session = AsyncSession(BrokerSettings(port=1), "pin-session", manual_ack=True)
        inner = paho_client_of(session._prepare())
        assert inner._manual_ack is True  # paho reads it before it PUBACKs
        props = Properties(PacketTypes.CONNACK)
        props.MaximumPacketSize = 4096
        inner.on_connect(inner, None, None, ReasonCode(PacketTypes.CONNACK, "Success"), props)
        assert session.max_packet_size == 4096
        assert session._client._connected.done()  # aiomqtt's own callback ran too

        loop = asyncio.get_running_loop()
        ok, refused = loop.create_future(), loop.create_future()
        session._pending.update({1: ok, 2: refused})
        inner.on_publish(inner, None, 1, ReasonCode(PacketTypes.PUBACK, "Success"), None)
        inner.on_publish(inner, None, 2, ReasonCode(PacketTypes.PUBACK, "Not authorized"), None)
        await ok
        with pytest.raises(BrokerError, match="Not authorized"):
            await refused

    asyncio.run(check())
