"""Talking to brokers: the session Protocols and their implementations, embedded Mosquitto.

Runtime components type against ``shoal.broker.session`` (``Session``, ``SessionFactory``,
``GatewaySession``) and receive a factory; the ``default_*_factory`` functions name the
implementations shoal runs on (aiomqtt, paho and mqtt5: the only modules that import them
live in this package). ``shoal.broker.memory`` is
an in-memory broker for logic tests. ``shoal.broker`` never imports ``shoal.processors``.
"""

from shoal.broker import _lean_properties
from shoal.broker._aio import AsyncSession
from shoal.broker._batched import BatchedSession
from shoal.broker._threaded import ThreadedSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.profiles import broker_profiles
from shoal.broker.session import (
    GatewaySessionFactory,
    Message,
    SessionFactory,
    Will,
    unique_client_id,
)
from shoal.broker.settings import BrokerSettings, TlsSettings

__all__ = [
    "AsyncSession",
    "BatchedSession",
    "BrokerSettings",
    "EmbeddedBroker",
    "Message",
    "ThreadedSession",
    "TlsSettings",
    "Will",
    "broker_profiles",
    "default_gateway_session_factory",
    "default_intake_session_factory",
    "default_output_session_factory",
    "default_session_factory",
    "default_worker_session_factory",
    "unique_client_id",
]

_lean_properties.install()


def default_session_factory() -> SessionFactory:
    """The ``Session`` implementation components use unless given another: ``AsyncSession``."""
    return AsyncSession


def default_worker_session_factory() -> SessionFactory:
    """The ``Session`` a worker reads batches and publishes partials on: ``BatchedSession``.

    paho copied a 16,000-row batch (187 KB) four times while parsing its PUBLISH and built
    ``Properties`` for each, and aiomqtt queued it once more: on ``BatchedSession`` the two
    workers of ``shoal bench pipeline`` at 6 M meas/s used 65-67.5 % of a core instead of
    76-78 %, and publish -> partials out p99 fell from 49-61 to 38-39 ms (docs/benchmarks.md,
    "The worker on ``BatchedSession``"). Read in ``WORKER_READ_BYTES`` pieces (``Worker``).
    """
    return BatchedSession


def default_gateway_session_factory() -> GatewaySessionFactory:
    """The ``GatewaySession`` gateways use unless given another: ``ThreadedSession``."""
    return ThreadedSession


def default_intake_session_factory() -> SessionFactory:
    """The ``Session`` for high-rate intake (``shoal adapt``): ``BatchedSession``.

    It hands over what each read of the socket brought at once (``message_batches``).
    """
    return BatchedSession


def default_output_session_factory() -> SessionFactory:
    """The ``Session`` a combiner publishes its results on: ``BatchedSession``.

    It writes a window's message once (paho copies what is left of a large packet again
    after every partial write) and the per-key results of a window in a few writes, and
    builds no paho ``Properties``/``ReasonCode`` objects per message (docs/benchmarks.md,
    "Window close → result").
    """
    return BatchedSession
