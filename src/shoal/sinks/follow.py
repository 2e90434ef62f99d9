"""The core every sink shares: follow a topic, acknowledge each message once it is safe.

Never imports a database or HTTP library.

The order of one message, written down here once (as the worker's ack order is in
``shoal.runtime.worker``):

1. the broker delivers it (QoS 1, persistent session ``clean_start=False`` under a stable
   client id, ``manual_ack``: nothing is acknowledged by the library);
2. ``Handler.handle`` makes it safe (a database commit, a 2xx from a web hook); it retries
   transient failures itself, with backoff, for as long as it takes;
3. only then ``Session.ack`` (PUBACK): a sink killed before this step gets the message again
   from its session when it comes back, so the handler must be idempotent.

``receive_maximum`` bounds the unacknowledged messages in flight to us: a slow destination
becomes a queue in the broker's session for this client, never an unbounded one in memory.
A broker failure closes the session; the follower opens a new one with the same client id
(what was delivered and not acknowledged comes again) and subscribes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

from shoal.broker import default_session_factory
from shoal.broker.session import Message, SessionFactory
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: ``first_s``, doubled each attempt, at most ``max_s``.

    Attributes:
        first_s: the first delay.
        max_s: the largest delay.
        factor: growth per attempt.
    """

    first_s: float = 0.2
    max_s: float = 10.0
    factor: float = 2.0

    def delay_s(self, attempt: int) -> float:
        """The delay before retry number ``attempt`` (1 is the first retry)."""
        return min(self.max_s, self.first_s * self.factor ** max(0, attempt - 1))


class Handler(Protocol):
    """What a sink does with one message; returns only once the message is safe.

    Raising ends the follower (and the sink process): a handler retries what can succeed
    later itself and raises only what needs an operator (then nothing is acknowledged).
    """

    async def handle(self, message: Message) -> None:
        """Make ``message`` safe at the destination (idempotently)."""


@dataclass(frozen=True, slots=True)
class FollowConfig:
    """Where to follow from.

    Attributes:
        broker: where the broker is.
        filters: topic filters to subscribe to (absolute, with the deployment's root).
        client_id: stable MQTT client id: the persistent session that keeps what we miss.
        session_expiry_s: how long the broker keeps the session while we are away.
        receive_maximum: unacknowledged messages in flight to us at most.
        reconnect: delays between attempts to reach the broker again.
    """

    broker: BrokerSettings
    filters: tuple[str, ...]
    client_id: str
    session_expiry_s: int = 86_400
    receive_maximum: int = 16
    reconnect: Backoff = field(default_factory=lambda: Backoff(0.2, 5.0))


@dataclass
class FollowStats:
    """What a follower did."""

    received: int = 0
    acknowledged: int = 0
    broker_reconnects: int = 0


class Follower:
    """Feeds every message of ``config.filters`` to ``handler``; acks after it returns.

    Runs until ``stop``; see the module docstring for the order of one message.
    """

    def __init__(
        self,
        config: FollowConfig,
        handler: Handler,
        *,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.config = config
        self.handler = handler
        self.stats = FollowStats()
        self.connected = asyncio.Event()
        self._connect = session_factory or default_session_factory()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Finish the message in hand, then return from ``run``.

        A handler still retrying then is cancelled by the caller (the CLI, after a grace
        period); its message was not acknowledged and comes again.
        """
        self._stop.set()

    async def run(self) -> FollowStats:
        """Follow until ``stop``; reconnect to the broker after failures."""
        config = self.config
        failures = 0
        while not self._stop.is_set():
            session = self._connect(
                config.broker,
                config.client_id,
                clean_start=False,
                session_expiry_s=config.session_expiry_s,
                receive_maximum=config.receive_maximum,
                manual_ack=True,
            )
            try:
                async with session:
                    await session.subscribe(list(config.filters), qos=1)
                    self.connected.set()
                    failures = 0
                    async for message in session.messages_until(self._stop):
                        await self._one(message)
                        session.ack(message)
                        self.stats.acknowledged += 1
            except BrokerError as exc:
                self.connected.clear()
                if self._stop.is_set():
                    break
                failures += 1
                self.stats.broker_reconnects += 1
                log.warning("sink: broker: %s; reconnecting", exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(config.reconnect.delay_s(failures)):
                        await self._stop.wait()
        return self.stats

    async def _one(self, message: Message) -> None:
        self.stats.received += 1
        await self.handler.handle(message)
