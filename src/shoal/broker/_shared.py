"""What every session implementation does the same way: size checks, PUBACK waits, stopping.

No third-party imports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from shoal.broker.session import PROTOCOL_OVERHEAD, Message
from shoal.errors import BrokerError, PayloadTooLargeError


def check_size(topic: str, payload: bytes, limit: int | None) -> None:
    """Refuse a message the broker would refuse (paho would reconnect and resend it forever).

    Raises:
        PayloadTooLargeError: it does not fit in ``limit`` bytes with the protocol overhead.
    """
    if limit is not None and len(payload) + len(topic) + PROTOCOL_OVERHEAD > limit:
        raise PayloadTooLargeError(
            f"message for {topic!r} is {len(payload)} bytes; the broker accepts packets of at "
            f"most {limit} bytes. It was not sent: split it or raise the broker's max_packet_size."
        )


async def wait_all(futures: Sequence[asyncio.Future[None]], timeout_s: float) -> None:
    """Wait for publish futures; ``BrokerError`` if they are not all done within the timeout."""
    if not futures:
        return
    try:
        await asyncio.wait_for(asyncio.gather(*futures), timeout=timeout_s)
    except TimeoutError as exc:
        raise BrokerError(f"no PUBACK within {timeout_s} s") from exc


async def until_stopped(
    messages: AsyncIterator[Message], stop: asyncio.Event
) -> AsyncIterator[Message]:
    """``messages`` until ``stop`` is set, then it ends (a receive still pending is cancelled).

    Raises:
        BrokerError: the connection was lost first.
    """
    iterator = messages.__aiter__()
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if nxt in done:
                yield nxt.result()
                continue
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, BrokerError):
                await nxt
            return
    finally:
        stopper.cancel()
