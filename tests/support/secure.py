"""A Mosquitto in the secure profile with one user per role, for integration tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

from shoal.broker.access import BrokerUser, Role
from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas.topics import Topics


@contextlib.contextmanager
def secure_broker(
    data_dir: Path, roles: Mapping[str, Role], password: str, topics: Topics
) -> Iterator[EmbeddedBroker]:
    """A started secure broker where each user of ``roles`` logs in with ``password``."""
    users = [BrokerUser(name, password, role) for name, role in roles.items()]
    broker = EmbeddedBroker("secure", data_dir=data_dir, users=users, topic_root=topics.root)
    broker.start()
    try:
        yield broker
    finally:
        broker.close()
