"""A real PostgreSQL server for sink tests (``shoal.loadtest.postgres``), and table readers."""

from __future__ import annotations

from collections.abc import Iterator

import polars as pl
import psycopg
import pytest
from psycopg import sql

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


def read_table(dsn: str, table: str) -> pl.DataFrame:
    """A whole table as a frame (``key`` as text, numbers as they are stored)."""
    with psycopg.connect(dsn) as conn:
        cursor = conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table)))
        names = [d.name for d in cursor.description or ()]
        rows = cursor.fetchall()
    return pl.DataFrame(rows, schema=names, orient="row", infer_schema_length=None)
