"""One connection that many users publish on, each through a lease it can end on its own.

A pool combiner hosts hundreds of partitions; each used to publish on a connection of its own
(two sessions per partition with the intake). ``PooledOutputs`` keeps one clean connection
for all of them (reopened when lost) and hands each user an ``OutputsLease``: a ``Session``
that publishes on it, counts what it started, and ends with its user.

What ending a lease guarantees (``OutputsLease.__aexit__``), the property a per-partition
connection got from the broker's session takeover: **nothing the user started reaches the
broker after the lease ended**. From the end on, the lease refuses publishes (their futures
fail with ``BrokerError``, like those of a closed connection); then it waits until every
QoS 1 publish it started is acknowledged or failed, and until the broker has processed
everything written on the connection before that (``FencedSession.sync``; on
``BatchedSession`` a PINGREQ's answer, which covers QoS 0 too). If that does not happen within
the publish timeout, the connection is reset (``FencedSession.abort``: nothing buffered is
sent) and every lease on it fails: a term ends (and its successor may start publishing) only
once its own publishes are at the broker or can no longer arrive.

A failure that belongs to one publish (a refused PUBACK, a message too large) fails only
that publish's future, as on a connection of its own. A lost connection fails every lease on
it; each user ends and starts again on the next connection.

The pool needs that fence from its sessions: a factory whose sessions are not a
``FencedSession`` is refused (``ConfigError`` from ``run`` and from every lease), not served
without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Final, Self

from shoal.broker._shared import SessionBase
from shoal.broker.session import FencedSession, Message, SessionFactory, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError, ConfigError

log = logging.getLogger(__name__)

CONNECT_WAIT_S: Final = 10.0
"""How long a lease waits for the shared connection to be (re)opened."""
RECONNECT_S: Final = 0.5
"""The pause between a lost shared connection and the next attempt."""
PUBLISH_TIMEOUT_S: Final = 30.0


class PooledOutputs:
    """One outputs connection for many users (see the module docstring).

    ``run`` keeps it open (a task of the owner's, cancelled when every lease has ended);
    ``lease`` gives a user its ``Session``.
    """

    def __init__(
        self,
        factory: SessionFactory,
        settings: BrokerSettings,
        client_id: str,
        *,
        will: Will | None = None,
    ) -> None:
        """Configure; nothing connects before ``run``; every connection carries ``will``."""
        self._factory = factory
        self._settings = settings
        self.client_id = client_id
        self._will = will
        self._current: FencedSession | None = None
        self._refused: ConfigError | None = None
        self._ready = asyncio.Event()
        self.connections = 0
        """Connections opened so far (a count for tests and logs)."""

    async def run(self) -> None:
        """Keep the connection open until cancelled; reopen it when lost.

        Raises:
            ConfigError: the factory's sessions cannot fence a lease's end (module docstring).
        """
        while True:
            session = self._factory(
                self._settings, self.client_id, will=self._will, publish_timeout_s=PUBLISH_TIMEOUT_S
            )
            if not isinstance(session, FencedSession):
                self._refused = ConfigError(
                    f"outputs {self.client_id}: a {type(session).__name__} cannot end a lease "
                    "safely (no sync/abort: shoal.broker.session.FencedSession)"
                )
                self._ready.set()  # waiting leases see the refusal at once
                raise self._refused
            try:
                async with session:
                    self._current = session
                    self.connections += 1
                    self._ready.set()
                    async for _ in session.messages():  # nothing is delivered: it is clean
                        pass
            except BrokerError as exc:
                log.warning("outputs %s: %s; reconnecting", self.client_id, exc)
            finally:
                self._current = None
                self._ready.clear()
            await asyncio.sleep(RECONNECT_S)

    async def session(self) -> FencedSession:
        """The open connection (waiting up to ``CONNECT_WAIT_S`` for one).

        Raises:
            BrokerError: none opened in time.
            ConfigError: the factory's sessions were refused (``run``).
        """
        try:
            async with asyncio.timeout(CONNECT_WAIT_S):
                while self._current is None:
                    if self._refused is not None:
                        raise self._refused
                    await self._ready.wait()
        except TimeoutError as exc:
            raise BrokerError(
                f"outputs {self.client_id}: no connection to the broker within {CONNECT_WAIT_S} s"
            ) from exc
        return self._current

    @property
    def current(self) -> FencedSession | None:
        """The connection open now (None: being reopened)."""
        return self._current

    def reset(self, why: str) -> None:
        """Drop the open connection at once (its Will fires; ``run`` opens another)."""
        if self._current is not None:
            self._current.abort(why)

    def lease(self) -> OutputsLease:
        """A new lease (it takes the connection when entered)."""
        return OutputsLease(self)


class OutputsLease(SessionBase):
    """One user's ``Session`` on a ``PooledOutputs`` connection: publishing only."""

    def __init__(self, pool: PooledOutputs) -> None:
        """Not yet on a connection: ``async with`` takes the current one."""
        self._pool = pool
        self.settings = pool._settings
        self.client_id = pool.client_id
        self._publish_timeout_s = PUBLISH_TIMEOUT_S
        self._inner: FencedSession | None = None
        self._ended = False
        self._in_flight: set[asyncio.Future[None]] = set()

    @property
    def inner(self) -> FencedSession:
        """The shared connection this lease publishes on."""
        if self._inner is None:
            raise BrokerError("the lease is not open (use `async with lease:`)")
        return self._inner

    async def __aenter__(self) -> Self:
        """Take the pool's open connection (the lease stays on it until it ends)."""
        self._inner = await self._pool.session()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End: refuse publishes, then wait until what was started is at the broker.

        On a connection that does not answer within the publish timeout, reset it (see the
        module docstring).
        """
        self._ended = True
        inner = self._inner
        if inner is None:
            return
        try:
            async with asyncio.timeout(self._publish_timeout_s):
                if self._in_flight:
                    await asyncio.wait(set(self._in_flight))
                await inner.sync()
        except (TimeoutError, BrokerError) as failure:
            if inner is self._pool.current:
                self._pool.reset(f"a lease's publishes were not settled at its end: {failure!r}")
            log.debug("outputs %s: a lease ended unsettled: %r", self.client_id, failure)

    @property
    def max_packet_size(self) -> int | None:
        """The connection's."""
        return self.inner.max_packet_size

    def publish_started(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
        user_properties: Sequence[tuple[str, str]] | None = None,
        message_expiry_s: int | None = None,
    ) -> asyncio.Future[None]:
        """Publish on the shared connection; after the lease ended, a failed future.

        Raises:
            PayloadTooLargeError: larger than the broker's maximum packet size; not sent.
        """
        if self._ended:
            refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            refused.set_exception(BrokerError("the outputs lease has ended"))
            return refused
        started = self.inner.publish_started(
            topic,
            payload,
            qos=qos,
            retain=retain,
            content_type=content_type,
            user_properties=user_properties,
            message_expiry_s=message_expiry_s,
        )
        if not started.done():
            self._in_flight.add(started)
            started.add_done_callback(self._in_flight.discard)
        return started

    def publish_columns(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        *,
        retain: bool = False,
        head: bytes = b"",
    ) -> None:
        """QoS 0 messages on the shared connection, at once, as two columns.

        Raises:
            PayloadTooLargeError: one is larger than the broker's maximum packet size; none
                was sent.
            BrokerError: the lease has ended, or not connected.
        """
        if self._ended:
            raise BrokerError("the outputs lease has ended")
        self.inner.publish_columns(topics, payloads, retain=retain, head=head)

    async def wait_published(self, futures: Sequence[asyncio.Future[None]]) -> None:
        """The connection's wait (its publish timeout)."""
        await self.inner.wait_published(futures)

    async def subscribe(
        self,
        filters: Sequence[str],
        qos: int = 1,
        *,
        no_local: bool = False,
        subscription_id: int | None = None,
    ) -> None:
        """Not on a shared outputs connection.

        Raises:
            BrokerError: always.
        """
        del filters, qos, no_local, subscription_id
        raise BrokerError("an outputs lease only publishes")

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Not on a shared outputs connection.

        Raises:
            BrokerError: always.
        """
        del filters
        raise BrokerError("an outputs lease only publishes")

    def ack(self, message: Message) -> None:
        """Nothing is received on it: nothing to acknowledge."""

    def messages(self) -> AsyncIterator[Message]:
        """Nothing is received on it.

        Raises:
            BrokerError: always.
        """
        raise BrokerError("an outputs lease only publishes")
