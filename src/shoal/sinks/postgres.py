"""``shoal sink postgres``: window results into a PostgreSQL table, exactly once.

The only module that imports psycopg. One wide table per pipeline (the table's name defaults
to the pipeline's), one row per (pipeline, window, slot, key) holding its latest revision::

    pipeline text, "window" text, slot bigint, start bigint, "end" bigint,
    key text (null: the null key), revision integer, correction boolean,
    partition integer, partitions integer, watermark bigint, emitted_at bigint,
    rows bigint, batches bigint, <one column per aggregate or per-row field, as the results
    name it: bigint where the results carry an integer (count, a count window's index,
    first_ts, last_ts), double precision otherwise>, written_at timestamptz
    UNIQUE NULLS NOT DISTINCT (pipeline, "window", slot, key)

``slot`` says which window of its key a row is: its ``start`` for time and session windows
(so the key is the issue's (pipeline, window, start, key)), its ``index`` for count windows,
whose ``start`` is the close step's span and may differ when a window is re-published
(``shoal.schemas.results.ROW_SLOT``). ``end`` is per row (a session's own end).

Wide, because that is how results are read (``SELECT start, key, mean FROM temps``) and
what Grafana's PostgreSQL source wants; the pipeline is still part of the key so several
pipelines may share one table (``--table``). Columns come from the messages, not from a
spec: a spec change that adds an aggregate adds its column (``ADD COLUMN IF NOT EXISTS``),
one that drops an aggregate leaves the column null in newer rows. A column of the wrong type
(a table made by hand) is a ``SinkError``: nothing is written or acknowledged until fixed.

Exactly once: each MQTT message is one transaction, a single ``INSERT ... SELECT FROM
unnest(...) ON CONFLICT ... DO UPDATE ... WHERE (excluded.revision, excluded.rows) >
(t.revision, t.rows)``, committed before the message is acknowledged (``shoal.sinks.follow``).
A copy delivered again (the sink killed before its PUBACK, a combiner re-publishing after a
restart) finds its rows already there with the same revision and rows and changes nothing;
a correction (higher revision) replaces them; an older revision arriving late never does.
This is ``shoal.schemas.results.latest_revisions``' rule, held by the database. A failed
connection or a server restart is retried with backoff on a fresh connection, the same
message again, for as long as it takes; nothing is acknowledged meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import polars as pl
import psycopg
from psycopg import sql

from shoal.broker.session import Message
from shoal.clock import Clock, SystemClock
from shoal.errors import SchemaError, SinkError
from shoal.schemas.results import (
    HEADER_SCHEMA,
    WindowMessage,
    field_dtype,
    parse_window_message,
)
from shoal.sinks.follow import Backoff

log = logging.getLogger(__name__)

IDENTIFIER_BYTES: Final = 63
"""PostgreSQL's identifier limit (longer names are silently truncated: we refuse them)."""

CONFLICT_KEY: Final = ("pipeline", "window", "slot", "key")
"""The table's unique key: one row per pipeline, window spec, window of its key and key."""

FIXED_COLUMNS: Final = (
    ("pipeline", "text NOT NULL"),
    ("window", "text NOT NULL"),
    ("slot", "bigint NOT NULL"),
    ("start", "bigint NOT NULL"),
    ("end", "bigint NOT NULL"),
    ("key", "text"),
    ("revision", "integer NOT NULL"),
    ("correction", "boolean NOT NULL"),
    ("partition", "integer NOT NULL"),
    ("partitions", "integer NOT NULL"),
    ("watermark", "bigint"),
    ("emitted_at", "bigint NOT NULL"),
    ("rows", "bigint NOT NULL"),
    ("batches", "bigint NOT NULL"),
)
"""Every table's columns before the aggregates, with their SQL types."""

_PER_ROW: Final = ("key", "slot", "end", "rows", "batches")
"""Columns with a value per result row (the rest of ``FIXED_COLUMNS`` is per message)."""


def aggregate_type(name: str) -> str:
    """The SQL type of a result column: bigint where results carry integers, else floats."""
    return "bigint" if field_dtype(name) == pl.Int64() else "double precision"


def check_identifier(name: str, what: str) -> str:
    """``name`` if PostgreSQL keeps it whole as an identifier; else ``SinkError``."""
    if not name or len(name.encode()) > IDENTIFIER_BYTES or "\x00" in name:
        raise SinkError(
            f"{what} {name!r} cannot be a PostgreSQL identifier (1-{IDENTIFIER_BYTES} bytes): "
            "choose another with --table"
        )
    return name


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    """Where results go.

    Attributes:
        dsn: a libpq connection string or URL (``postgresql://user@host:5432/db``).
        pipeline: the pipeline whose results are written; messages of another are skipped.
        table: the table (default: the pipeline's name); use the DSN's ``options`` for a
            schema other than ``public`` (``options=-csearch_path=shoal``).
        retry: delays between attempts while the database is unreachable.
        connect_timeout_s: how long one connection attempt may take.
    """

    dsn: str
    pipeline: str
    table: str = ""
    retry: Backoff = field(default_factory=lambda: Backoff(0.2, 5.0))
    connect_timeout_s: float = 5.0

    @property
    def table_name(self) -> str:
        """The table's name, checked."""
        return check_identifier(self.table or self.pipeline, "table name")


@dataclass
class PostgresStats:
    """What the PostgreSQL sink did (``--json``)."""

    messages: int = 0
    rows: int = 0
    rows_changed: int = 0
    rows_unchanged: int = 0
    unreadable: int = 0
    other_pipeline: int = 0
    db_retries: int = 0
    db_connects: int = 0
    columns_added: int = 0
    commit_seconds: float = 0.0
    last_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return asdict(self)


class PostgresSink:
    """A ``shoal.sinks.follow.Handler`` that upserts window messages (module docstring)."""

    def __init__(self, config: PostgresConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.table = config.table_name
        self.stats = PostgresStats()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._columns: dict[str, str] = {}

    async def close(self) -> None:
        """Close the database connection."""
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def handle(self, message: Message) -> None:
        """Write one window message; returns once it is committed (retrying until it is)."""
        self.stats.messages += 1
        try:
            window = parse_window_message(message.payload, message.content_type)
        except SchemaError as exc:
            # Cannot ever be written: counted, reported, acknowledged.
            self.stats.unreadable += 1
            log.warning("sink postgres: unreadable result on %s skipped: %s", message.topic, exc)
            return
        if window.pipeline != self.config.pipeline:
            self.stats.other_pipeline += 1
            return
        if window.frame.height == 0:
            return
        attempt = 0
        while True:
            try:
                await self._write(window)
            except (psycopg.OperationalError, psycopg.errors.SerializationFailure) as exc:
                # The server went away, restarted or refused the connection: retry the same
                # message on a new connection. Nothing was acknowledged.
                attempt += 1
                self.stats.db_retries += 1
                self.stats.last_error = str(exc).strip().splitlines()[0] if str(exc) else ""
                await self._drop_connection()
                delay = self.config.retry.delay_s(attempt)
                log.warning(
                    "sink postgres: %s; retrying in %.1f s (attempt %d)",
                    self.stats.last_error,
                    delay,
                    attempt,
                )
                await asyncio.sleep(delay)
            except psycopg.Error as exc:
                raise SinkError(
                    f"PostgreSQL refused the results of {window.pipeline} {window.window} "
                    f"start {window.start} for table {self.table!r}: {exc}"
                ) from exc
            else:
                return

    async def _write(self, window: WindowMessage) -> None:
        conn = await self._connection()
        aggregates = [
            c for c in window.frame.columns if c not in HEADER_SCHEMA and c not in _PER_ROW
        ]
        started = self.clock.monotonic()
        async with conn.transaction():
            await self._ensure_columns(conn, aggregates)
            cursor = await conn.execute(
                _upsert_statement(self.table, tuple(aggregates)), _params(window, aggregates)
            )
            changed = max(cursor.rowcount, 0)
        self.stats.commit_seconds += self.clock.monotonic() - started
        self.stats.rows += window.frame.height
        self.stats.rows_changed += changed
        self.stats.rows_unchanged += window.frame.height - changed

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.config.dsn,
                autocommit=True,
                connect_timeout=max(1, round(self.config.connect_timeout_s)),
            )
            self.stats.db_connects += 1
            self._columns = {}
        return self._conn

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except psycopg.Error:
                log.debug("sink postgres: closing a broken connection failed", exc_info=True)

    async def _ensure_columns(
        self, conn: psycopg.AsyncConnection[Any], aggregates: list[str]
    ) -> None:
        """Create the table and any missing aggregate column; check the types we rely on."""
        if self._columns and all(a in self._columns for a in aggregates):
            return
        table = sql.Identifier(self.table)
        if not self._columns:
            columns = [
                sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(kind))
                for name, kind in FIXED_COLUMNS
            ]
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} ({}, written_at timestamptz NOT NULL "
                    "DEFAULT now(), CONSTRAINT {} UNIQUE NULLS NOT DISTINCT ({}))"
                ).format(
                    table,
                    sql.SQL(", ").join(columns),
                    sql.Identifier(check_identifier(f"{self.table[:50]}_identity", "constraint")),
                    sql.SQL(", ").join(map(sql.Identifier, CONFLICT_KEY)),
                )
            )
        for name in aggregates:
            check_identifier(name, "aggregate column")
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    table, sql.Identifier(name), sql.SQL(aggregate_type(name))
                )
            )
        cursor = await conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = %s AND table_schema = current_schema()",
            (self.table,),
        )
        found = {str(name): str(kind) for name, kind in await cursor.fetchall()}
        added = len(set(aggregates) - set(self._columns))
        for name in aggregates:
            if found.get(name) != aggregate_type(name):
                raise SinkError(
                    f"column {name!r} of table {self.table!r} is {found.get(name)}, "
                    f"results need {aggregate_type(name)}: alter or drop the column"
                )
        self.stats.columns_added += added if self._columns else 0
        self._columns = found


def _upsert_statement(table_name: str, aggregates: tuple[str, ...]) -> sql.Composed:
    """``INSERT ... SELECT FROM unnest ... ON CONFLICT ... DO UPDATE ... WHERE newer``."""
    header = [name for name, _ in FIXED_COLUMNS if name not in _PER_ROW]
    per_row = [*_PER_ROW, *aggregates]
    row_types = ["text", "bigint", "bigint", "bigint", "bigint"]
    row_types += [aggregate_type(a) for a in aggregates]
    table = sql.Identifier(table_name)
    every = [*header, *per_row]
    updated = [c for c in every if c not in CONFLICT_KEY]
    return sql.SQL(
        "INSERT INTO {table} AS t ({columns}) "
        "SELECT {header}, u.* FROM unnest({arrays}) AS u({names}) "
        "ON CONFLICT ({key}) DO UPDATE SET {updates}, written_at = now() "
        "WHERE (excluded.revision, excluded.rows) > (t.revision, t.rows)"
    ).format(
        table=table,
        columns=sql.SQL(", ").join(map(sql.Identifier, every)),
        header=sql.SQL(", ").join(sql.Placeholder(name) for name in header),
        arrays=sql.SQL(", ").join(
            sql.SQL("{}::{}[]").format(sql.Placeholder(f"_{i}"), sql.SQL(kind))
            for i, kind in enumerate(row_types)
        ),
        names=sql.SQL(", ").join(map(sql.Identifier, per_row)),
        key=sql.SQL(", ").join(map(sql.Identifier, CONFLICT_KEY)),
        updates=sql.SQL(", ").join(
            sql.SQL("{} = excluded.{}").format(sql.Identifier(c), sql.Identifier(c))
            for c in updated
        ),
    )


def _params(window: WindowMessage, aggregates: list[str]) -> dict[str, Any]:
    frame = window.frame
    params: dict[str, Any] = {
        "pipeline": window.pipeline,
        "window": window.window,
        "start": window.start,
        "revision": window.revision,
        "correction": window.revision > 1,
        "partition": window.partition,
        "partitions": window.partitions,
        "watermark": window.watermark,
        "emitted_at": window.emitted_at,
    }
    slot = frame["index"] if "index" in frame.columns else frame["start"]
    columns = {**{name: frame[name] for name in frame.columns}, "slot": slot}
    for i, name in enumerate([*_PER_ROW, *aggregates]):
        column = columns[name]
        if aggregate_type(name) == "bigint" or name in _PER_ROW[1:]:
            column = column.cast(pl.Int64)
        params[f"_{i}"] = column.to_list()
    return params
