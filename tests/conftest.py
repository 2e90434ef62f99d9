"""Shared fixtures: a real broker per test, a private topic namespace per test.

``SHOAL_TEST_BROKER=mosquitto|mochi`` (default mosquitto) picks the broker every test starts:
it becomes ``SHOAL_EMBEDDED_BROKER`` for this run, which ``EmbeddedBroker`` (the ``broker`` fixture,
the tests that build their own, and the shoal processes the tests spawn) reads. A test that
depends on one broker's documented behaviour says so with
``@pytest.mark.broker_quirk("mosquitto", reason=...)``: on another broker it runs as a strict
xfail (it must fail there; if it starts passing, the marker is stale), or with
``run=False`` it is skipped, reason shown, when running it there makes no sense.

``make test`` runs the suite on several pytest-xdist workers. Every test
starts its own broker on a free port in its own temporary folder, so tests run side by side;
a test that uses a module-scoped fixture (a secure broker, a browser, a PostgreSQL server) is
kept on one worker with the rest of its module, so that the fixture is made once.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.broker._mochi import mochi_binary, mochi_version
from shoal.broker.embedded import BROKER_ENV, EmbeddedBroker, check_broker
from shoal.errors import ShoalError
from shoal.schemas.topics import Topics

TEST_BROKER_ENV = "SHOAL_TEST_BROKER"


def selected_broker() -> str:
    """The broker this run tests against (``SHOAL_TEST_BROKER``, default mosquitto)."""
    return check_broker(os.environ.get(TEST_BROKER_ENV) or "mosquitto")


def pytest_configure(config: pytest.Config) -> None:
    try:
        broker = selected_broker()
        if broker == "mochi":
            mochi_binary()
    except ShoalError as exc:
        raise pytest.UsageError(f"{TEST_BROKER_ENV}: {exc}") from exc
    os.environ[BROKER_ENV] = broker


def pytest_report_header(config: pytest.Config) -> str:
    broker = selected_broker()
    if broker == "mochi":
        binary = mochi_binary()
        return f"broker: mochi (Mochi MQTT {mochi_version(binary)}, {binary})"
    return f"broker: {broker}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    broker = selected_broker()
    for item in items:
        # Any test that starts a broker is a `broker` test, whether or not it says so.
        if "broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.broker)
        for quirk in item.iter_markers("broker_quirk"):
            (owner,) = quirk.args
            check_broker(owner)
            if owner == broker or item.get_closest_marker("broker") is None:
                continue  # its broker, or a variant on the in-memory broker
            reason = f"relies on {owner}'s behaviour, not {broker}'s: {quirk.kwargs['reason']}"
            if quirk.kwargs.get("run", True):
                item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
            else:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load scheduling, with each module that has a module-scoped fixture as one unit.

    (``--dist loadgroup`` cannot do it with pytest 9.2: xdist 3.8 renames the items to group
    them, which pytest 9.2 no longer allows.) The scheduler sees node ids only, so the modules
    are found by their source: one that defines ``scope="module"`` or uses the PostgreSQL
    server of tests/support/postgres.py."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 - only under xdist

    if config.getvalue("dist") != "load":
        return None  # another --dist asked for
    grouped = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if _MODULE_FIXTURE.search(path.read_text(encoding="utf-8"))
    }

    class ModuleUnits(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in grouped else nodeid

    return ModuleUnits(config, log)


ROOT = Path(__file__).resolve().parent.parent
_MODULE_FIXTURE = re.compile(r'scope="module"|tests\.support\.postgres import')


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """A running broker (dev profile) on a free port; stopped (then killed) after the test."""
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
