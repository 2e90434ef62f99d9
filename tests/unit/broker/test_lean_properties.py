"""``LeanProperties``: paho's MQTT 5 properties, same bytes and behaviour, shared tables."""

from __future__ import annotations

import paho.mqtt._packet as paho_packet
import paho.mqtt.client as paho_client
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import MQTTException, Properties

import shoal.broker  # noqa: F401 (installs LeanProperties)
from shoal.broker._lean_properties import LeanProperties

# every property paho knows, with a value of its type, and a packet it belongs to
SAMPLES = [
    (PacketTypes.PUBLISH, "PayloadFormatIndicator", 1),
    (PacketTypes.PUBLISH, "MessageExpiryInterval", 300),
    (PacketTypes.PUBLISH, "ContentType", "application/msgpack"),
    (PacketTypes.PUBLISH, "ResponseTopic", "reply/here"),
    (PacketTypes.PUBLISH, "CorrelationData", b"\x00\x01"),
    (PacketTypes.PUBLISH, "SubscriptionIdentifier", [7]),
    (PacketTypes.PUBLISH, "TopicAlias", 3),
    (PacketTypes.PUBLISH, "UserProperty", [("k", "v"), ("k", "w")]),
    (PacketTypes.CONNECT, "SessionExpiryInterval", 3600),
    (PacketTypes.CONNECT, "ReceiveMaximum", 64),
    (PacketTypes.CONNECT, "TopicAliasMaximum", 10),
    (PacketTypes.CONNECT, "MaximumPacketSize", 1 << 20),
    (PacketTypes.CONNECT, "RequestProblemInformation", 0),
    (PacketTypes.CONNECT, "RequestResponseInformation", 1),
    (PacketTypes.CONNECT, "AuthenticationMethod", "SCRAM"),
    (PacketTypes.CONNECT, "AuthenticationData", b"abc"),
    (PacketTypes.CONNACK, "AssignedClientIdentifier", "auto-1"),
    (PacketTypes.CONNACK, "ServerKeepAlive", 30),
    (PacketTypes.CONNACK, "ResponseInformation", "info"),
    (PacketTypes.CONNACK, "ServerReference", "other:1883"),
    (PacketTypes.CONNACK, "ReasonString", "because"),
    (PacketTypes.CONNACK, "MaximumQoS", 1),
    (PacketTypes.CONNACK, "RetainAvailable", 0),
    (PacketTypes.CONNACK, "WildcardSubscriptionAvailable", 1),
    (PacketTypes.CONNACK, "SubscriptionIdentifierAvailable", 1),
    (PacketTypes.CONNACK, "SharedSubscriptionAvailable", 1),
    (PacketTypes.WILLMESSAGE, "WillDelayInterval", 5),
]


def _filled(cls: type[Properties], packet: int, items: list[tuple[str, object]]) -> Properties:
    props = cls(packet)  # type: ignore[no-untyped-call]
    for name, value in items:
        setattr(props, name, value)
    return props


def test_every_property_packs_to_pahos_bytes_and_reads_back_the_same() -> None:
    for packet in sorted({p for p, _, _ in SAMPLES}):
        items = [(n, v) for p, n, v in SAMPLES if p == packet]
        paho_props = _filled(Properties, packet, items)
        lean = _filled(LeanProperties, packet, items)
        wire = bytes(paho_props.pack())  # type: ignore[no-untyped-call]
        assert bytes(lean.pack()) == wire  # type: ignore[no-untyped-call]
        read_paho = Properties(packet)  # type: ignore[no-untyped-call]
        read_paho.unpack(wire)  # type: ignore[no-untyped-call]
        read_lean = LeanProperties(packet)
        read_lean.unpack(wire)  # type: ignore[no-untyped-call]
        assert read_lean.json() == read_paho.json() != {}  # type: ignore[no-untyped-call]
        assert not read_lean.isEmpty()
        read_lean.unpack(bytes(Properties(packet).pack()))  # type: ignore[no-untyped-call]
        assert read_lean.isEmpty()
        assert read_lean.json() == {}


def test_paho_validation_still_applies() -> None:
    props = LeanProperties(PacketTypes.PUBLISH)
    with pytest.raises(MQTTException, match="must be one of"):
        props.NoSuchProperty = 1
    with pytest.raises(MQTTException, match="does not apply"):
        props.ReceiveMaximum = 5  # a CONNECT property
    with pytest.raises(MQTTException, match="range"):
        LeanProperties(PacketTypes.CONNECT).ReceiveMaximum = 0
    props.UserProperty = ("a", "1")
    props.UserProperty = ("b", "2")  # may repeat: appended
    assert props.UserProperty == [("a", "1"), ("b", "2")]
    assert props.getIdentFromName("UserProperty") == 38
    assert props.getIdentFromName("Nope") == -1
    assert props.getNameFromIdent(38) == "User Property"


def test_installed_where_paho_builds_properties() -> None:
    assert paho_client.Properties is LeanProperties
    assert paho_packet.Properties is LeanProperties
    # a parsed PUBLISH carries a LeanProperties with what was sent
    sent = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    sent.ContentType = "application/json"
    body = b"\x00\x03a/b" + bytes(sent.pack()) + b"payload"  # type: ignore[no-untyped-call]
    packet = paho_packet.decode_publish(0x30, body, paho_client.MQTTv5)
    assert isinstance(packet.properties, LeanProperties)
    assert packet.properties.ContentType == "application/json"
    assert packet.payload == b"payload"


def test_the_tables_are_shared_not_copied() -> None:
    a, b = LeanProperties(PacketTypes.PUBLISH), LeanProperties(PacketTypes.CONNACK)
    assert a.names is b.names
    assert a.properties is b.properties
    assert set(vars(a)) == {"packetType"}
