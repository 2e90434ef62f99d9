"""Talking to brokers: the one MQTT module, the embedded Mosquitto launcher, settings.

``shoal.broker`` never imports ``shoal.processors``.
"""

from shoal.broker.embedded import EmbeddedBroker, broker_profiles
from shoal.broker.mqtt import AsyncSession, Message, ThreadedSession, Will, unique_client_id
from shoal.broker.settings import BrokerSettings, TlsSettings

__all__ = [
    "AsyncSession",
    "BrokerSettings",
    "EmbeddedBroker",
    "Message",
    "ThreadedSession",
    "TlsSettings",
    "Will",
    "broker_profiles",
    "unique_client_id",
]
