"""Run a process's coroutine with its Prometheus ``/metrics`` endpoint beside it."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from shoal.errors import ConfigError

if TYPE_CHECKING:
    from shoal.observe import Collector

T = TypeVar("T")


async def exposed(
    main: Awaitable[T],
    address: tuple[str, int] | None,
    collector: Callable[[], Collector],
    name: str,
) -> T:
    """Await ``main`` while ``/metrics`` serves ``collector()`` on ``address`` (None: off).

    The endpoint's URL is printed on stderr once it listens (with port 0, the port chosen).
    """
    if address is None:
        return await main
    from shoal.observe import MetricsEndpoint  # noqa: PLC0415 - only when asked for

    host, port = address
    endpoint = MetricsEndpoint([collector()], host=host, port=port)
    try:
        bound = await endpoint.start()
    except OSError as exc:
        close = getattr(main, "close", None)
        if close is not None:
            close()  # never awaited: say so to the coroutine, not to the warnings filter
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    print(f"{name}: metrics on http://{host}:{bound}/metrics", file=sys.stderr, flush=True)
    try:
        return await main
    finally:
        await endpoint.close()
