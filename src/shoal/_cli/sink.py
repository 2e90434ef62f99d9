"""``shoal sink postgres|webhook``: deliver a pipeline's results (or alerts) outside MQTT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from shoal._cli.common import (
    add_broker_options,
    add_metrics_options,
    add_stop_option,
    broker_settings,
    metrics_address,
    stop_timeout,
    topics,
)
from shoal.errors import ConfigError
from shoal.schemas.topics import check_segment

if TYPE_CHECKING:
    from shoal.sinks.follow import Handler


def register(sub: Any) -> None:
    """Add the ``sink`` sub-command and its two kinds."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "sink",
        help="write window results to PostgreSQL, or POST results/alerts to a web hook",
        description="Follow a pipeline's window results (or alerts) with a persistent MQTT "
        "session and deliver each message outside MQTT, acknowledging it to the broker only "
        "once it is safe there: committed in PostgreSQL (exactly once: idempotent upserts by "
        "pipeline, window, start and key, keeping the latest revision) or answered 2xx by a "
        "web hook (at least once, with an Idempotency-Key header). A sink that is killed or "
        "loses its destination catches up from its session when it returns. README, "
        "'Sinks'.",
    )
    kinds = parser.add_subparsers(dest="sink", metavar="KIND", required=True)
    pg = kinds.add_parser(
        "postgres",
        help="upsert window results into a PostgreSQL table, exactly once",
        description="Upsert every window result of a pipeline into one wide PostgreSQL "
        "table (created if missing; a column per aggregate, added when a spec gains one), "
        "one row per (pipeline, window, start, key) holding its latest revision. Each MQTT "
        "message is one transaction, committed before its acknowledgement; a restarting "
        "database is retried with backoff. The password may come from PGPASSWORD or "
        "~/.pgpass (libpq) instead of the DSN.",
    )
    pg.add_argument(
        "--dsn",
        required=True,
        help="libpq connection string or URL, e.g. postgresql://shoal@127.0.0.1:5432/shoal",
    )
    pg.add_argument("--table", default="", help="table name (default: the pipeline's name)")
    _common(pg, "shoal-sink-postgres-<pipeline>-<table>")
    pg.set_defaults(run=run_postgres)
    hook = kinds.add_parser(
        "webhook",
        help="POST each window result (or alert transition) to a URL, at least once",
        description="POST every message to URL as published (JSON), with an Idempotency-Key "
        "header that is the same for every copy of one result or alert. 2xx: delivered and "
        "acknowledged; connection errors, time-outs, 408/425/429 and 5xx: retried with "
        "exponential backoff (Retry-After honoured); other answers: counted as refused and "
        "skipped. --alerts follows shoal/alerts/<pipeline>/# instead of the window results.",
    )
    hook.add_argument("--url", required=True, help="http:// or https:// URL to POST to")
    hook.add_argument(
        "--alerts",
        action="store_true",
        help="post the pipeline's alert transitions (shoal/alerts/<pipeline>/#) instead of "
        "its window results",
    )
    hook.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra request header (repeatable), e.g. 'Authorization: Bearer ...'",
    )
    hook.add_argument(
        "--timeout", type=float, default=10.0, help="seconds per request (%(default)s)"
    )
    hook.add_argument(
        "--max-backoff",
        type=float,
        default=60.0,
        help="longest pause between retries of one message, seconds (%(default)s)",
    )
    _common(hook, "shoal-sink-webhook-<pipeline>, with -alerts after it for --alerts")
    hook.set_defaults(run=run_webhook)


def _common(parser: argparse.ArgumentParser, default_client_id: str) -> None:
    parser.add_argument("--pipeline", required=True, metavar="NAME", help="the pipeline")
    add_broker_options(parser)
    parser.add_argument(
        "--client-id",
        default="",
        help=f"MQTT client id of the persistent session (default {default_client_id}): "
        "one per running sink; the broker keeps what the sink misses while it is away",
    )
    parser.add_argument(
        "--session-expiry",
        type=int,
        default=86_400,
        help="seconds the broker keeps the session while the sink is away (%(default)s)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=10.0,
        help="seconds between progress lines on stderr (0: none; %(default)s)",
    )
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="write the final counters as JSON to FILE"
    )
    add_metrics_options(parser)
    add_stop_option(parser)


class _Stats(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def run_postgres(args: argparse.Namespace) -> int:
    """Run the PostgreSQL sink until Ctrl-C, SIGTERM or ``--duration``."""
    try:
        from shoal.sinks.postgres import PostgresConfig, PostgresSink  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"shoal sink postgres needs psycopg ({exc}): pip install 'shoal[sinks]'"
        ) from exc

    pipeline = check_segment(args.pipeline, "pipeline")
    sink = PostgresSink(PostgresConfig(dsn=args.dsn, pipeline=pipeline, table=args.table))
    space = topics(args)
    client_id = args.client_id or f"shoal-sink-postgres-{pipeline}-{sink.table}"

    def line() -> str:
        s = sink.stats
        return (
            f"{s.messages:,} messages, {s.rows:,} rows ({s.rows_changed:,} "
            f"changed, {s.rows_unchanged:,} already there), {s.unreadable} unreadable, "
            f"{s.db_retries} database retries"
        )

    return _follow(
        args,
        handler=sink,
        client_id=client_id,
        filters=(space.results(pipeline),),
        target=f"table {sink.table!r}",
        progress=line,
        stats=sink.stats,
        close=sink.close,
    )


def run_webhook(args: argparse.Namespace) -> int:
    """Run the web hook sink until Ctrl-C, SIGTERM or ``--duration``."""
    from shoal.sinks.follow import Backoff  # noqa: PLC0415
    from shoal.sinks.webhook import WebhookConfig, WebhookSink  # noqa: PLC0415

    pipeline = check_segment(args.pipeline, "pipeline")
    headers = []
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ConfigError(f"--header {item!r}: write it as NAME:VALUE")
        headers.append((name.strip(), value.strip()))
    sink = WebhookSink(
        WebhookConfig(
            url=args.url,
            timeout_s=args.timeout,
            retry=Backoff(0.5, args.max_backoff),
            headers=tuple(headers),
        )
    )
    space = topics(args)
    what = space.alerts_filter(pipeline) if args.alerts else space.results(pipeline)
    suffix = "-alerts" if args.alerts else ""
    client_id = args.client_id or f"shoal-sink-webhook-{pipeline}{suffix}"

    def line() -> str:
        s = sink.stats
        return (
            f"{s.messages:,} messages, {s.delivered:,} delivered, {s.retries} retries, "
            f"refused {s.refused or 'none'}"
        )

    return _follow(
        args,
        handler=sink,
        client_id=client_id,
        filters=(what,),
        target=args.url,
        progress=line,
        stats=sink.stats,
        close=None,
    )


def _follow(
    args: argparse.Namespace,
    *,
    handler: Handler,
    client_id: str,
    filters: tuple[str, ...],
    target: str,
    progress: Callable[[], str],
    stats: _Stats,
    close: Callable[[], Awaitable[None]] | None,
) -> int:
    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal._stopping import stop_signals  # noqa: PLC0415
    from shoal.observe.collectors import SinkCollector  # noqa: PLC0415
    from shoal.sinks.follow import FollowConfig, Follower  # noqa: PLC0415

    follower = Follower(
        FollowConfig(
            broker=broker_settings(args),
            filters=filters,
            client_id=client_id,
            session_expiry_s=args.session_expiry,
        ),
        handler,
    )
    name = f"shoal sink {args.sink}"
    address = metrics_address(args)
    grace = stop_timeout(args)

    async def heartbeat() -> None:
        while args.heartbeat > 0:
            await asyncio.sleep(args.heartbeat)
            print(f"{name}: {progress()}", file=sys.stderr, flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        running = asyncio.create_task(
            exposed(
                follower.run(),
                address,
                lambda: SinkCollector(args.sink, args.pipeline, follower, stats.to_dict),
                name,
            )
        )

        def stop() -> None:
            follower.stop()
            # The message in hand, if still retrying then, is not acknowledged: it comes again.
            loop.call_later(grace, running.cancel)

        if args.duration:
            loop.call_later(args.duration, stop)
        beat = asyncio.create_task(heartbeat())
        connected = asyncio.create_task(follower.connected.wait())
        try:
            with stop_signals(name, lambda: loop.call_soon_threadsafe(stop), grace):
                await asyncio.wait({running, connected}, return_when=asyncio.FIRST_COMPLETED)
                if connected.done():
                    # Printed once subscribed: a script may wait for this line.
                    print(
                        f"{name}: following {', '.join(filters)} into {target} as {client_id}",
                        file=sys.stderr,
                        flush=True,
                    )
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        finally:
            for task in (beat, connected):
                task.cancel()
            if close is not None:
                await close()

    started = time.monotonic()
    asyncio.run(main())
    report = {
        **stats.to_dict(),
        **{f"mqtt_{k}": v for k, v in vars(follower.stats).items()},
        "wall_s": round(time.monotonic() - started, 3),
    }
    if args.json:
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"{name}: {progress()}")
    return 0
