"""``shoal tail <pipeline>``: print window results as they arrive."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from typing import Any

import orjson

from shoal._cli.common import add_broker_options, broker_settings, topics


def register(sub: Any) -> None:
    """Add the ``tail`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "tail",
        help="print a pipeline's window results as they arrive",
        description="Subscribe to results/<pipeline> and print each closed window.",
    )
    parser.add_argument("pipeline", help="pipeline name")
    add_broker_options(parser)
    parser.add_argument("--keys", type=int, default=5, help="keys shown per window (default 5)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON messages")
    parser.add_argument("--late", action="store_true", help="also print late-row reports")
    parser.add_argument("--count", type=int, default=0, help="exit after this many windows")
    parser.add_argument("--timeout", type=float, default=0, help="exit after this many seconds")
    parser.set_defaults(run=run)


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def format_window(message: dict[str, Any], keys: int) -> str:
    """A few lines describing one window message."""
    head = (
        f"{message['window']} [{_when(message['start'])}, {_when(message['end'])}) "
        f"partition {message['partition'] + 1}/{message['partitions']}: "
        f"{message['keys']} keys, {message['rows']} rows"
    )
    if message.get("parts", 1) > 1:  # one of the parts of a window too large for a packet
        head += f" (part {message['part'] + 1}/{message['parts']})"
    lines = [head]
    for row in message.get("results", [])[:keys]:
        fields = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in row.items()
            if k not in ("key", "batches")
        )
        lines.append(f"  {row['key']}: {fields}")
    if message["keys"] > keys:
        lines.append(f"  ... {message['keys'] - keys} more keys")
    return "\n".join(lines)


def _last_part(payload: bytes) -> bool:
    """Whether a message ends a window (a whole one, or its last part): ``--count`` counts it."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return True
    if not isinstance(body, dict):
        return True
    return bool(body.get("part", 0) == body.get("parts", 1) - 1)


def run(args: argparse.Namespace) -> int:
    """Print results until Ctrl-C, ``--count`` windows or ``--timeout``."""
    from shoal.broker import AsyncSession, unique_client_id  # noqa: PLC0415

    names = topics(args)
    settings = broker_settings(args)

    async def main() -> int:
        seen = 0
        async with AsyncSession(settings, unique_client_id("shoal-tail")) as session:
            filters = [names.results(args.pipeline)]
            if args.late:
                filters.append(names.late(args.pipeline))
            await session.subscribe(filters, qos=1)
            print(f"tailing {', '.join(filters)} on {settings.url}", file=sys.stderr)
            async for message in session.messages():
                if args.json:
                    print(message.payload.decode(errors="replace"), flush=True)
                else:
                    body = orjson.loads(message.payload)
                    if message.topic == names.late(args.pipeline):
                        print(
                            f"late: gateway {body['gateway_id']} seq {body['seq']}: "
                            f"{body['rows']} rows",
                            flush=True,
                        )
                        continue
                    print(format_window(body, args.keys), flush=True)
                if _last_part(message.payload):
                    seen += 1
                if args.count and seen >= args.count:
                    return 0
        return 0

    try:
        if args.timeout:
            return asyncio.run(asyncio.wait_for(main(), args.timeout))
        return asyncio.run(main())
    except TimeoutError:
        return 0
