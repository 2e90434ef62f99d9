"""The PostgreSQL sink's rules, message by message, on a real server: latest revision wins in
any arrival order, copies change nothing, the null key is a key, a new aggregate adds its
column, a column of the wrong type stops the sink, an unreadable message is counted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from shoal.broker.session import Message
from shoal.errors import SinkError
from shoal.loadtest.postgres import EmbeddedPostgres, read_table
from shoal.sinks.postgres import PostgresConfig, PostgresSink
from tests.support.postgres import postgres

_ = postgres  # the fixture, imported for this module
GOLDEN = Path(__file__).parents[2] / "schemas" / "golden" / "outputs"


def golden(name: str) -> dict[str, Any]:
    return orjson.loads((GOLDEN / name).read_bytes())


def write(sink: PostgresSink, *bodies: dict[str, Any] | bytes) -> None:
    async def go() -> None:
        try:
            for body in bodies:
                payload = body if isinstance(body, bytes) else orjson.dumps(body)
                await sink.handle(Message("results/x", payload, qos=1))
        finally:
            await sink.close()

    asyncio.run(go())


def test_latest_revision_wins_in_any_order(postgres: EmbeddedPostgres) -> None:
    first = golden("result-window.json")
    correction = {
        **first,
        "revision": 2,
        "correction": True,
        "rows": 4,
        "results": [{**first["results"][0], "rows": 3, "count": 3, "mean": 30.0}],
    }
    copy = {**first, "emitted_at": first["emitted_at"] + 9_000}
    for table, order in (("in_order", [first, copy, correction]), ("late", [correction, first])):
        sink = PostgresSink(PostgresConfig(postgres.dsn, "temps", table))
        write(sink, *order)
        rows = {r["key"]: r for r in read_table(postgres.dsn, table).iter_rows(named=True)}
        assert set(rows) == {"t1", "t2"}
        assert (rows["t1"]["revision"], rows["t1"]["rows"], rows["t1"]["mean"]) == (2, 3, 30.0)
        assert rows["t1"]["correction"] is True
        assert (rows["t2"]["revision"], rows["t2"]["mean"], rows["t2"]["stddev"]) == (1, 3.0, None)
        assert rows["t2"]["p99"] == first["results"][1]["p99"]
        assert sink.stats.rows_unchanged == (2 if table == "in_order" else 1)


def test_null_key_new_aggregates_and_unreadable_messages(postgres: EmbeddedPostgres) -> None:
    body = golden("result-window-null-key.json")
    sink = PostgresSink(PostgresConfig(postgres.dsn, "by-unit", "by_unit"))
    grown = {
        **body,
        "start": body["end"],
        "end": body["end"] + 60_000,
        "results": [{**r, "max": 5.0} for r in body["results"]],
    }
    other = {**body, "pipeline": "another"}
    write(sink, body, body, grown, other, b"{not json", b"")
    table = read_table(postgres.dsn, "by_unit").sort("start", "key", nulls_last=True)
    assert table["key"].to_list() == ["°C", None, "°C", None]
    assert table["max"].to_list() == [None, None, 5.0, 5.0]
    assert sink.stats.rows == 6
    assert sink.stats.rows_unchanged == 2  # the copy of the first message
    assert sink.stats.other_pipeline == 1
    assert sink.stats.unreadable == 2


def test_a_column_of_the_wrong_type_stops_the_sink(postgres: EmbeddedPostgres) -> None:
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(
            'CREATE TABLE handmade (pipeline text, "window" text, start bigint, mean text)'
        )
    sink = PostgresSink(PostgresConfig(postgres.dsn, "temps", "handmade"))
    with pytest.raises(SinkError, match="mean"):
        write(sink, golden("result-window.json"))


def test_names_postgres_would_truncate_are_refused() -> None:
    with pytest.raises(SinkError, match="--table"):
        PostgresSink(PostgresConfig("postgresql://x@127.0.0.1:1/x", "p", "t" * 64))


def test_count_and_session_windows(postgres: EmbeddedPostgres) -> None:
    count = golden("result-window-count.json")
    # re-published after a combiner restart in a message of another start: the same window
    again = {**count, "start": count["start"] + 700, "emitted_at": count["emitted_at"] + 1}
    second = {
        **count,
        "results": [{**count["results"][0], "index": 1, "first_ts": 1_700_000_000_300}],
    }
    sink = PostgresSink(PostgresConfig(postgres.dsn, "counts", "counts"))
    write(sink, count, again, second)
    table = read_table(postgres.dsn, "counts").sort("slot")
    assert table["slot"].to_list() == table["index"].to_list() == [0, 1]
    assert table["first_ts"].to_list() == [1_700_000_000_000, 1_700_000_000_300]
    assert table["start"].to_list() == [count["start"], count["start"]]
    assert sink.stats.rows_unchanged == 1

    session = golden("result-window-session.json")
    sink = PostgresSink(PostgresConfig(postgres.dsn, "visits", "visits"))
    write(sink, session)
    table = read_table(postgres.dsn, "visits").sort("key")
    assert table["end"].to_list() == [r["end"] for r in session["results"]]
    assert table["slot"].to_list() == [session["start"]] * 2


def test_a_session_retraction_is_stored_with_no_rows_and_its_new_start(
    postgres: EmbeddedPostgres,
) -> None:
    """A late piece moved t2's session to an earlier start: revision 2 of the old start's
    message retracts t2 (rows 0, ``superseded_by`` the new start) and the new start's message
    holds the session. Latest revision wins per (window, start, key) in any order, so the
    old row becomes the retraction and never comes back; copies change nothing."""
    first = golden("result-window-session.json")
    retraction = golden("result-window-session-correction.json")
    moved_to = retraction["results"][1]["superseded_by"]
    moved = {
        **first,
        "start": moved_to,
        "end": first["results"][1]["end"],
        "keys": 1,
        "rows": 3,
        "emitted_at": retraction["emitted_at"],
        "results": [{**first["results"][1], "rows": 3, "count": 3, "mean": 5.0}],
    }
    orders = {
        "in_order": [first, retraction, moved, retraction],
        "retraction_first": [moved, retraction, first],
    }
    for table, order in orders.items():
        sink = PostgresSink(PostgresConfig(postgres.dsn, "visits", f"visits_{table}"))
        write(sink, *order)
        got = read_table(postgres.dsn, f"visits_{table}")
        rows = {(r["slot"], r["key"]): r for r in got.iter_rows(named=True)}
        assert set(rows) == {(first["start"], "t1"), (first["start"], "t2"), (moved_to, "t2")}
        gone = rows[(first["start"], "t2")]
        assert (gone["revision"], gone["rows"], gone["batches"], gone["count"]) == (2, 0, 0, 0)
        assert gone["mean"] is None
        assert gone["superseded_by"] == moved_to
        assert gone["correction"] is True
        kept = rows[(first["start"], "t1")]
        assert (kept["revision"], kept["rows"], kept["superseded_by"]) == (2, 3, None)
        new = rows[(moved_to, "t2")]
        assert (new["revision"], new["rows"], new["start"]) == (1, 3, moved_to)
        assert new["superseded_by"] is None
        assert sink.stats.rows_unchanged == 2  # the copy, or revision 1 after revision 2
    with psycopg.connect(postgres.dsn) as conn:
        kind = conn.execute(
            "SELECT data_type FROM information_schema.columns "
            "WHERE table_name = 'visits_in_order' AND column_name = 'superseded_by'"
        ).fetchone()
    assert kind == ("bigint",)  # an epoch-ms start, exact
