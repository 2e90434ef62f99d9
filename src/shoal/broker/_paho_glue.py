"""paho-mqtt details both MQTT sessions share: properties, TLS, reason codes, socket options.

Imported only by ``shoal.broker._aio`` and ``shoal.broker._threaded`` (and by
``shoal.broker._batched`` for ``tls_context``).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Sequence
from typing import Any, Final

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from shoal.broker.session import Message
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError

NO_DELAY: Final = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
"""Disable Nagle's algorithm: paho leaves it on, and Nagle plus delayed ACKs holds small
packets (PUBACKs, small partials) back for up to 40 ms."""


def no_delay(client: paho.Client, userdata: Any, sock: Any) -> None:
    """A paho ``on_socket_open`` callback that sets ``NO_DELAY``."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(*NO_DELAY)


RECEIVE_MAXIMUM_ABSENT: Final = 65_535
"""A CONNACK without Receive Maximum allows 65,535 unacknowledged QoS > 0 publishes (MQTT 5,
3.2.2.3.3)."""


def adopt_send_quota(client: paho.Client, props: Properties | None) -> int:
    """Keep as many QoS 1 publishes unacknowledged as the broker's CONNACK allows; the quota.

    The broker announces in its CONNACK how many QoS > 0 publishes it takes at once (its
    Receive Maximum; Mosquitto's is ``max_inflight_messages``). paho keeps its own default of 20
    otherwise, and its setter refuses any change on an open connection, though paho reads the
    limit afresh before every send: so it is set here, from the CONNACK, in the ``on_connect``
    callback, which paho calls before it sends anything queued. With 20, a combiner's window of
    1,000 retained per-key results took 50 round trips to leave and the alerts queued behind
    them reached a dashboard 40-65 ms after the window (docs/benchmarks.md, "Alert latency").
    """
    quota = getattr(props, "ReceiveMaximum", None) if props is not None else None
    client._max_inflight_messages = int(quota) if quota else RECEIVE_MAXIMUM_ABSENT
    return client.max_inflight_messages


def connect_properties(session_expiry_s: int, receive_maximum: int | None = None) -> Properties:
    """CONNECT properties: session expiry and, if given, our Receive Maximum."""
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = session_expiry_s
    if receive_maximum is not None:
        props.ReceiveMaximum = receive_maximum
    return props


def publish_properties(
    content_type: str | None,
    user_properties: Sequence[tuple[str, str]] | None,
    message_expiry_s: int | None,
) -> Properties | None:
    """PUBLISH properties, or None when there are none (the common, cheaper case)."""
    if content_type is None and not user_properties and message_expiry_s is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if content_type is not None:
        props.ContentType = content_type
    if user_properties:
        props.UserProperty = list(user_properties)
    if message_expiry_s is not None:
        props.MessageExpiryInterval = message_expiry_s
    return props


def subscribe_properties(subscription_id: int | None) -> Properties | None:
    """SUBSCRIBE properties carrying a Subscription Identifier (None: no identifier)."""
    if subscription_id is None:
        return None
    props = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
    props.SubscriptionIdentifier = subscription_id
    return props


def message_properties(
    props: Properties | None,
) -> tuple[str | None, tuple[tuple[str, str], ...], tuple[int, ...]]:
    """The content type, user properties and subscription identifiers of a received PUBLISH."""
    if props is None:
        return None, (), ()
    user = getattr(props, "UserProperty", None)
    # paho keeps every Subscription Identifier of the PUBLISH (there may be several) in a list.
    ids = getattr(props, "SubscriptionIdentifier", None)
    return (
        getattr(props, "ContentType", None),
        tuple(user) if user else (),
        tuple(ids) if ids else (),
    )


def payload_format(props: Properties | None) -> int | None:
    """The payload format indicator of a received PUBLISH (1: UTF-8 text), if set."""
    value = getattr(props, "PayloadFormatIndicator", None)
    return value if isinstance(value, int) else None


def message_from_paho(msg: paho.MQTTMessage) -> Message:
    """Our ``Message`` for a paho one."""
    props = getattr(msg, "properties", None)
    content_type, user_properties, ids = message_properties(props)
    return Message(
        topic=msg.topic,
        payload=bytes(msg.payload),
        qos=msg.qos,
        retain=bool(msg.retain),
        content_type=content_type,
        user_properties=user_properties,
        mid=msg.mid,
        payload_format=payload_format(props),
        subscription_ids=ids,
    )


def tls_context(settings: BrokerSettings) -> ssl.SSLContext | None:
    """The client TLS context for ``settings`` (None: plain TCP).

    Raises:
        BrokerError: the CA, certificate or key file cannot be loaded.
    """
    tls = settings.tls
    if tls is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
        if tls.cert_file is not None:
            context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise BrokerError(f"cannot load TLS files for {settings.url}: {exc}") from exc
    context.check_hostname = tls.verify_hostname
    return context


def reason_failed(reason: ReasonCode | int) -> bool:
    """Whether an MQTT reason code (or a MQTT 3 return code) says the request failed."""
    if isinstance(reason, ReasonCode):
        return bool(reason.is_failure)
    return reason != 0


def reason_value(code: ReasonCode | int) -> int:
    """The number of a reason code (paho's object, or already an int)."""
    return code.value if isinstance(code, ReasonCode) else code


def publish_error(topic: str, rc: int) -> BrokerError:
    """The error for a publish paho refused to send."""
    return BrokerError(f"publish to {topic!r} failed: {paho.error_string(rc)}")
