"""A real PostgreSQL server for sink tests (``shoal.loadtest.postgres``), one per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shoal.loadtest.postgres import EmbeddedPostgres


@pytest.fixture(scope="module")
def postgres() -> Iterator[EmbeddedPostgres]:
    """One PostgreSQL server per test module (initdb is slow); tests use their own tables."""
    server = EmbeddedPostgres()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
