"""``ThreadedSession``: the ``GatewaySession`` on paho's threaded client, for gateways."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from shoal.broker._paho_glue import (
    adopt_send_quota,
    connect_properties,
    message_from_paho,
    no_delay,
    publish_error,
    publish_properties,
    reason_failed,
    tls_context,
)
from shoal.broker._shared import check_size
from shoal.broker.session import GatewaySession, Message, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError

log = logging.getLogger(__name__)


class PahoPublishHandle:
    """A QoS 1 publish in flight from a ``ThreadedSession`` (a ``PublishHandle``)."""

    def __init__(self, info: paho.MQTTMessageInfo, done: threading.Event) -> None:
        self._info = info
        self._done = done
        self.failed: str | None = None

    @property
    def mid(self) -> int:
        """The packet id."""
        return self._info.mid

    def is_acknowledged(self) -> bool:
        """Whether the broker has accepted it (PUBACK with a success code)."""
        return self._done.is_set() and self.failed is None

    def wait(self, timeout_s: float) -> bool:
        """Wait for the PUBACK; False on timeout. Raises BrokerError if refused."""
        ok = self._done.wait(timeout_s)
        if ok and self.failed is not None:
            raise BrokerError(f"broker refused a publish: {self.failed}")
        return ok


class ThreadedSession:
    """A self-reconnecting MQTT 5 connection driven by paho's network thread (for gateways).

    Implements ``shoal.broker.session.GatewaySession`` (see there for the callbacks); the
    class is also its ``GatewaySessionFactory``.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        client_id: str,
        *,
        on_message: Callable[[Message], None] | None = None,
        on_connect: Callable[[GatewaySession], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_acknowledged: Callable[[], None] | None = None,
        session_expiry_s: int = 0,
        will: Will | None = None,
    ) -> None:
        self.settings = settings
        self._on_acknowledged = on_acknowledged
        self.client_id = client_id
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._connected = threading.Event()
        self._lock = threading.Lock()  # guards _pending/_early; never held while calling paho
        self._pending: dict[int, PahoPublishHandle] = {}
        self._early: dict[int, ReasonCode | int] = {}
        self._max_packet_size: int | None = None
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv5,
            reconnect_on_failure=True,
        )
        if settings.username is not None:
            self._client.username_pw_set(settings.username, settings.password)
        context = tls_context(settings)
        if context is not None:
            self._client.tls_set_context(context)
        if will is not None:
            self._client.will_set(will.topic, will.payload, will.qos, will.retain)
        self._client.reconnect_delay_set(min_delay=1, max_delay=5)
        self._session_expiry_s = session_expiry_s
        self._client.on_connect = self._handle_connect
        self._client.on_disconnect = self._handle_disconnect
        self._client.on_publish = self._handle_publish
        self._client.on_message = self._handle_message
        self._client.on_socket_open = no_delay
        self._started = False

    @property
    def connected(self) -> bool:
        """Whether the session is connected right now."""
        return self._connected.is_set()

    @property
    def max_packet_size(self) -> int | None:
        """The broker's Maximum Packet Size from the last CONNACK."""
        return self._max_packet_size

    @property
    def send_quota(self) -> int:
        """QoS 1 publishes kept unacknowledged at once: the last CONNACK's Receive Maximum."""
        return self._client.max_inflight_messages

    def start(self) -> None:
        """Start connecting in the background (returns at once)."""
        self._client.connect_async(
            self.settings.host,
            self.settings.port,
            keepalive=self.settings.keepalive_s,
            clean_start=True,
            properties=connect_properties(self._session_expiry_s),
        )
        self._client.loop_start()
        self._started = True

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected; False on timeout."""
        return self._connected.wait(timeout_s)

    def stop(self) -> None:
        """Disconnect cleanly and stop the network thread."""
        if not self._started:
            return
        self._client.disconnect()
        self._client.loop_stop()
        self._started = False
        self._connected.clear()

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        """Subscribe (call from ``on_connect`` so it is renewed after reconnects)."""
        self._client.subscribe(topic_filter, qos=qos)

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
    ) -> PahoPublishHandle:
        """Start a publish; the handle reports its PUBACK.

        Raises:
            PayloadTooLargeError: larger than the broker accepts; not sent.
            BrokerError: not connected.
        """
        check_size(topic, payload, self._max_packet_size)
        if not self._connected.is_set():
            raise BrokerError(f"not connected to {self.settings.url}")
        props = publish_properties(content_type, None, None)
        # Not under self._lock: paho's thread calls on_publish holding paho's message mutex,
        # which paho's publish() takes too; holding ours across it would deadlock (AB/BA).
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise publish_error(topic, info.rc)
        handle = PahoPublishHandle(info, threading.Event())
        if qos == 0:
            handle._done.set()
            return handle
        with self._lock:
            early = self._early.pop(info.mid, None)
            if early is None:
                self._pending[info.mid] = handle
        if early is not None:  # the PUBACK raced ahead of publish() returning
            self._settle(handle, early)
        return handle

    def _settle(self, handle: PahoPublishHandle, reason: ReasonCode | int) -> None:
        if reason_failed(reason):
            handle.failed = str(reason)
        handle._done.set()
        if self._on_acknowledged is not None:
            self._on_acknowledged()

    def _handle_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any = None
    ) -> None:
        if reason_failed(reason):
            log.warning("broker %s refused the connection: %s", self.settings.url, reason)
            return
        self._max_packet_size = getattr(props, "MaximumPacketSize", None) if props else None
        adopt_send_quota(client, props)
        self._connected.set()
        if self._on_connect is not None:
            self._on_connect(self)

    def _handle_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any = None
    ) -> None:
        self._connected.clear()
        with self._lock:
            # In-flight publishes will never be acknowledged on this connection.
            for handle in self._pending.values():
                handle.failed = f"disconnected ({reason})"
                handle._done.set()
            self._pending.clear()
            self._early.clear()
        if self._on_disconnect is not None:
            self._on_disconnect()

    def _handle_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode, props: Any
    ) -> None:
        with self._lock:
            handle = self._pending.pop(mid, None)
            if handle is None:
                self._early[mid] = reason  # PUBACK raced ahead of publish() returning
                return
        self._settle(handle, reason)

    def _handle_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        if self._on_message is not None:
            try:
                self._on_message(message_from_paho(msg))
            except Exception:
                log.exception("message handler failed for %s", msg.topic)
