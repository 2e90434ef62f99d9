"""Shared fixtures: a real Mosquitto per test, a private topic namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas.topics import Topics


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Any test that starts a broker is a `broker` test, whether or not it says so.
    for item in items:
        if "broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.broker)


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """A running Mosquitto (dev profile) on a free port; stopped (then killed) after the test."""
    data_dir = tmp_path_factory.mktemp("broker")
    embedded = EmbeddedBroker("dev", data_dir=data_dir)
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.close()


@pytest.fixture
def topics() -> Topics:
    """A topic namespace no other test shares."""
    return Topics(root=f"test-{uuid.uuid4().hex[:12]}")
