"""The adapter: device messages in (shared subscription), shoal batches out (as a gateway).

Lifecycle: ``Adapter(config)``; ``await run()`` opens the gateway (its spool, its seq), then
connects with a persistent session (stable client id, ``clean_start=False``, manual
acknowledgement) and joins ``$share/<group>/<filter>`` for every route, again after every
reconnect; ``stop()`` seals what it holds, acknowledges it and closes the gateway.

The order that keeps the exactly-once chain from the adapter on (``_commit`` is the one
function that acknowledges, ``_seal`` the one that seals):

1. decode each device message as it arrives (a refusal becomes a dead letter, started now);
2. per group — what one read of the socket returned (``Session.message_batches``), or, one
   message at a time, when the input pauses (``stall_ms``) or ``max_messages`` wait —
   append the group's rows to the intake log (``shoal.adapters.intake``), wait for the
   group's dead letters' (and Sparkplug commands') PUBACKs, then PUBACK the device messages,
   in arrival order (``Session.ack_many``: one write);
3. once ``max_rows`` rows are logged or the oldest waited ``max_delay_ms``: write the seal
   mark, add the rows to the gateway and seal them into its spool (``Gateway.flush``).

A kill -9 before 2 loses nothing (the broker re-sends every unacknowledged message to the
returning session); after 2 the rows are in the log, and the log recognises the broker's
re-sends of its messages and hands back the rows that were not sealed yet. From the spool on,
the gateway library guarantees delivery end to end (seq, confirmations, re-sends). What holds
between device and adapter is in ``docs/guarantees.md`` ("Devices and adapters").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from shoal.adapters.decode import Decoder, Row
from shoal.adapters.intake import Entry, IntakeLog
from shoal.adapters.mapping import Mapping, Route
from shoal.broker import default_gateway_session_factory, default_intake_session_factory
from shoal.broker.session import (
    GatewaySessionFactory,
    Message,
    Session,
    SessionFactory,
)
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SystemClock
from shoal.errors import BrokerError, InputError, SchemaError, SpoolError
from shoal.gateway import Gateway, GatewayConfig
from shoal.schemas import DEFAULT_LIMITS, Topics
from shoal.schemas.deadletter import DEADLETTER_HEADROOM, deadletter_message

log = logging.getLogger(__name__)

_RECONNECT_S: Final = (0.2, 0.5, 1.0, 2.0, 5.0)
_ANNOUNCE_POLL_S: Final = 0.02  # how often ``ready`` checks that the gateway is announced
_CLOSE_WAIT_S: Final = 5.0
"""At stop, how long a connected gateway waits for its last confirmations (inside the 8 s
a stopping process is given, ``shoal._stopping``); an unconnected one does not wait."""
_ROUTES_KEEP: Final = 100_000
"""Topics whose route is remembered (cleared when exceeded)."""
_DEDUPE_KEEP: Final = 100_000
"""(topic, message id) pairs remembered per adapter for routes that name a message id."""


class MessageDecoder(Protocol):
    """Turns a route's device messages into rows (``Decoder``, ``SparkplugDecoder``)."""

    def decode(self, topic: str, levels: dict[str, str], payload: bytes, now_ms: int) -> list[Row]:
        """The rows of one message, or ``InputError`` with a specific reason."""

    def take_commands(self) -> list[tuple[str, bytes]]:
        """Messages to publish to devices (Sparkplug rebirth requests), taken once."""

    def take_refusals(self) -> list[InputError]:
        """Parts of the last message refused while its other rows were kept, taken once."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """One adapter process.

    Attributes:
        mapping: what to read and how.
        adapter_id: stable name: the gateway id of its batches (``ingest/<stream>/<id>``) and
            part of its MQTT client id; a restarted adapter must reuse it (same session, same
            spool, same seq).
        broker: where the broker is (device topics and shoal topics on the same one).
        topics: shoal's topic namespace (device topics are the mapping's, as written).
        spool_dir: the gateway spool (and intake log) folder; None keeps both in memory
            (tests only: a restart then loses what was not confirmed).
        session_expiry_s: how long the broker keeps the adapter's session (and queues its
            share of device messages) while it is away.
        resend_after_ms: the gateway's re-send timer.
        spool_fsync: fsync spool writes (power-loss safe) instead of relying on the page cache.
    """

    mapping: Mapping
    adapter_id: str
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    topics: Topics = field(default_factory=Topics)
    spool_dir: Path | None = None
    session_expiry_s: int = 24 * 3600
    resend_after_ms: int = 5_000
    spool_fsync: bool = False

    @property
    def client_id(self) -> str:
        """The MQTT client id of the device-side session (stable: a persistent session)."""
        return f"shoal-adapt-{self.adapter_id}"

    def gateway_config(self) -> GatewayConfig:
        """The gateway the adapter acts as."""
        return GatewayConfig(
            self.adapter_id,
            stream=self.mapping.stream,
            broker=self.broker,
            topics=self.topics,
            batch_size=DEFAULT_LIMITS.max_rows,
            max_delay_ms=3_600_000,  # the adapter seals; the gateway never does on its own
            spool_dir=self.spool_dir,
            spool_fsync=self.spool_fsync,
            resend_after_ms=self.resend_after_ms,
            max_future_ms=None,  # checked per device message, so one bad row refuses one message
        )


@dataclass
class AdapterStats:
    """Counters of one adapter run.

    Attributes:
        messages: device messages received (redeliveries included).
        rows: measurement rows sealed into the gateway spool.
        seals: seals (each one or more gateway batches).
        refused: dead-lettered device messages, by reason.
        redeliveries: broker re-sends of messages already in the intake log, dropped.
        duplicates: device re-sends dropped by message id.
        commands: messages published to devices (Sparkplug rebirth requests).
        groups: groups of device messages logged and acknowledged (one intake-log write and
            one PUBACK write each): ``messages / groups`` is how many a write acknowledges.
    """

    messages: int = 0
    rows: int = 0
    seals: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    redeliveries: int = 0
    duplicates: int = 0
    commands: int = 0
    groups: int = 0


@dataclass
class _Pending:
    """What arrived since the last seal."""

    messages: list[Message] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)  # of the messages that gave rows
    rows: list[Row] = field(default_factory=list)
    waits: list[asyncio.Future[None]] = field(default_factory=list)
    first_at_s: float | None = None


class Adapter:
    """Reads device topics and acts as a shoal gateway for what it reads.

    Args:
        config: the adapter's settings.
        clock: time source (arrival time stamps, batch age).
        session_factory: the device-side MQTT session (default ``BatchedSession``: batches).
        gateway_session_factory: the gateway's MQTT session (default ``ThreadedSession``).
        decoders: per route index, a decoder to use instead of the built-in one (Sparkplug).
    """

    def __init__(
        self,
        config: AdapterConfig,
        *,
        clock: Clock | None = None,
        session_factory: SessionFactory | None = None,
        gateway_session_factory: GatewaySessionFactory | None = None,
        decoders: dict[int, MessageDecoder] | None = None,
    ) -> None:
        self.config = config
        self.stats = AdapterStats()
        self._clock: Clock = clock or SystemClock()
        self._connect = session_factory or default_intake_session_factory()
        self._gateway_connect = gateway_session_factory or default_gateway_session_factory()
        mapping = config.mapping
        self._decoders: dict[int, MessageDecoder] = {
            r.index: Decoder(r, max_future_ms=mapping.max_future_ms)
            for r in mapping.routes
            if r.format != "sparkplug"
        }
        self._decoders.update(decoders or {})
        for route in mapping.routes:
            if route.index not in self._decoders:  # Sparkplug: protobuf only when used
                from shoal.adapters.sparkplug import SparkplugDecoder  # noqa: PLC0415

                self._decoders[route.index] = SparkplugDecoder(
                    route, max_future_ms=mapping.max_future_ms, rebirth=mapping.sparkplug_rebirth
                )
        log_path = None if config.spool_dir is None else config.spool_dir / "intake.log"
        self._intake = IntakeLog(
            log_path, horizon=mapping.batching.max_messages, fsync=config.spool_fsync
        )
        self._pending = _Pending()
        self._rows: list[Row] = []  # logged (and acknowledged), not yet sealed
        self._rows_since_s: float | None = None
        self._last_arrival_s = 0.0
        self._seen_ids: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._routes: dict[str, tuple[Route, dict[str, str]] | None] = {}
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._gateway: Gateway | None = None
        self._deadletter_topic = config.topics.deadletter(mapping.name)
        self.ready = asyncio.Event()

    # -- public -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Seal and acknowledge what is held, then stop (``run`` returns)."""
        self._stop.set()

    @property
    def gateway(self) -> Gateway:
        """The gateway the adapter acts as (once ``run`` opened it)."""
        if self._gateway is None:
            raise BrokerError("the adapter is not running")
        return self._gateway

    async def run(self) -> None:
        """Run until ``stop()``: reconnect on lost connections, seal, acknowledge."""
        config = self.config
        if config.spool_dir is not None:
            config.spool_dir.mkdir(parents=True, exist_ok=True)
        gateway = Gateway(
            config.gateway_config(), self._clock, session_factory=self._gateway_connect
        ).start()
        self._gateway = gateway
        recovered = self._intake.recover(gateway.stats().next_seq)
        if recovered:
            log.info("adapter %s: sealing %d logged rows again", config.adapter_id, len(recovered))
            self._rows = recovered
            self._seal()
        attempt = 0
        try:
            while not self._stop.is_set():
                try:
                    await self._session_round()
                    attempt = 0
                except BrokerError as exc:
                    delay = _RECONNECT_S[min(attempt, len(_RECONNECT_S) - 1)]
                    attempt += 1
                    log.warning(
                        "adapter %s: %s; reconnecting in %.1f s", config.adapter_id, exc, delay
                    )
                    self._pending = _Pending()  # unacknowledged: the broker sends them again
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._stop.wait()
        finally:
            await asyncio.to_thread(self._close_gateway, gateway)
            self._intake.close()

    def _close_gateway(self, gateway: Gateway) -> None:
        """Seal what is held and close; what is not confirmed stays in the spool."""
        connected = gateway.stats().connected
        if gateway.close(_CLOSE_WAIT_S if connected else 0.0):
            return
        left = gateway.stats().spool_batches
        if left:
            log.warning(
                "adapter %s: stopped with %d batch(es) unconfirmed%s: %s",
                self.config.adapter_id,
                left,
                "" if connected else " (the broker is unreachable)",
                "they stay in the spool and the next start sends them again"
                if self.config.spool_dir is not None
                else "without a spool folder they are lost",
            )

    # -- one connection ---------------------------------------------------------------------

    async def _session_round(self) -> None:
        config = self.config
        mapping = config.mapping
        session = self._connect(
            config.broker,
            config.client_id,
            clean_start=False,
            session_expiry_s=config.session_expiry_s,
            receive_maximum=mapping.batching.max_messages,
            manual_ack=True,
        )
        async with session:
            self._intake.arm()
            # Consume while the SUBSCRIBE is pending: a returning persistent session gets its
            # queued messages first, and a SUBACK stuck behind a large backlog that nobody
            # drains would time out, reconnect and never get anywhere.
            tasks = {
                asyncio.create_task(self._subscribe(session)),
                asyncio.create_task(self._tick(session)),
            }
            consuming = asyncio.create_task(self._consume(session))
            tasks.add(consuming)
            try:
                while not consuming.done():
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # a failed subscribe, tick or receive ends the round
                    tasks -= done
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _subscribe(self, session: Session) -> None:
        filters = self.config.mapping.subscriptions
        await session.subscribe(filters, qos=1)
        log.info("adapter %s: subscribed to %s", self.config.adapter_id, ", ".join(filters))
        # Ready once the pipeline knows its gateway too: device messages taken before that
        # may fall into windows other gateways' progress has closed already (late rows).
        # The PUBACK that announces it arrives on the gateway's own network thread: polled.
        while not self.gateway.announced():  # noqa: ASYNC110 - set by another thread
            await asyncio.sleep(_ANNOUNCE_POLL_S)
        self.ready.set()

    async def _consume(self, session: Session) -> None:
        """Take what arrived together as one group: decode it, log it, acknowledge it.

        The broker keeps sending while a group is decoded (up to the Receive Maximum), so
        acknowledging per read keeps the link busy.
        """
        max_messages = self.config.mapping.batching.max_messages
        async for batch in session.message_batches(self._stop):
            self._take_batch(session, batch)
            if len(self._pending.messages) >= max_messages or len(batch) > 1:
                await self._commit(session)
        await self._commit(session)
        self._seal()

    async def _tick(self, session: Session) -> None:
        """Commit when the input stalls; seal when enough rows are logged or they aged.

        The broker sends at most its in-flight limit of unacknowledged messages, and we
        acknowledge only after a commit: once the input pauses for ``stall_ms``, waiting
        longer would only wait for ourselves.
        """
        batching = self.config.mapping.batching
        delay_s = batching.max_delay_ms / 1000.0
        stall_s = batching.stall_ms / 1000.0
        while True:
            now = self._clock.monotonic()
            if self._pending.messages and now - self._last_arrival_s >= stall_s:
                await self._commit(session)
            since = self._rows_since_s
            if since is not None and now - since >= delay_s:
                self._seal()
            await asyncio.sleep(stall_s / 2 if self._pending.messages else min(0.005, delay_s))

    # -- one message ------------------------------------------------------------------------

    def _take_batch(self, session: Session, messages: list[Message]) -> None:
        """Decode device messages that arrived together into the pending rows."""
        now_s = self._clock.monotonic()
        now_ms = self._clock.now_ms()
        self.stats.messages += len(messages)
        self._last_arrival_s = now_s
        pending = self._pending
        if pending.first_at_s is None:
            pending.first_at_s = now_s
        pending.messages.extend(messages)
        take = self._take
        for message in messages:
            take(session, message, now_ms)

    def _route(self, topic: str) -> tuple[Route, dict[str, str]] | None:
        """The route of ``topic`` (remembered per topic: devices repeat theirs)."""
        try:
            return self._routes[topic]
        except KeyError:
            pass
        found = self.config.mapping.route_for(topic)
        if len(self._routes) >= _ROUTES_KEEP:
            self._routes.clear()
        self._routes[topic] = found
        return found

    def _take(self, session: Session, message: Message, now_ms: int) -> None:
        """Decode one device message into the pending rows (or a dead letter)."""
        entry = (message.mid, message.topic, zlib.crc32(message.payload))
        pending = self._pending
        if self._intake.armed and self._intake.is_redelivery(entry):
            self.stats.redeliveries += 1
            return  # acknowledged with this group; its rows are logged already
        found = self._route(message.topic)
        if found is None:
            mapping = self.config.mapping
            patterns = [r.topic.text for r in mapping.routes]
            error = InputError(
                f"no route of mapping {mapping.name!r} matches topic {message.topic!r}",
                reason="no_route",
                expected=f"a topic matching one of {patterns}",
                found=repr(message.topic),
            )
            self._refuse(session, message, error)
            return
        route, levels = found
        decoder = self._decoders[route.index]
        try:
            rows = decoder.decode(message.topic, levels, message.payload, now_ms)
        except InputError as exc:
            self._refuse(session, message, exc)
            rows = []
        for error in decoder.take_refusals():
            self._refuse(session, message, error)
        for topic, payload in decoder.take_commands():
            self.stats.commands += 1
            pending.waits.append(session.publish_started(topic, payload, qos=0))
        if rows and route.message_id is not None and self._is_duplicate(route, message):
            self.stats.duplicates += 1
            return
        if rows:
            pending.entries.append(entry)
            pending.rows.extend(rows)

    def _is_duplicate(self, route: Route, message: Message) -> bool:
        """Whether the device sent this message id on this topic recently (JSON routes)."""
        import orjson  # noqa: PLC0415 - decoded once more only for routes that dedupe

        try:
            body = orjson.loads(message.payload)
        except orjson.JSONDecodeError:
            return False
        ident = body.get(route.message_id) if isinstance(body, dict) else None
        if ident is None:
            return False
        key = (message.topic, str(ident))
        if key in self._seen_ids:
            return True
        self._seen_ids[key] = None
        if len(self._seen_ids) > _DEDUPE_KEEP:
            self._seen_ids.popitem(last=False)
        return False

    def _refuse(self, session: Session, message: Message, error: InputError) -> None:
        """Start the dead letter for a refused message; the seal waits for its PUBACK."""
        self.stats.refused[error.reason] += 1
        max_packet = session.max_packet_size
        record = deadletter_message(
            pipeline=self.config.mapping.name,
            topic=message.topic,
            content_type=message.content_type,
            payload=message.payload,
            error=error.as_record(),
            worker=self.config.client_id,
            at_ms=self._clock.now_ms(),
            max_bytes=None if max_packet is None else max_packet - DEADLETTER_HEADROOM,
        )
        self._pending.waits.append(
            session.publish_started(
                self._deadletter_topic,
                record,
                user_properties=[("reason", error.reason), ("code", error.code)],
            )
        )

    # -- commit (the one place that acknowledges) and seal -----------------------------------

    async def _commit(self, session: Session) -> None:
        """Log the pending group's rows, wait for its dead letters, acknowledge its messages."""
        async with self._lock:
            pending, self._pending = self._pending, _Pending()
            if not pending.messages:
                return
            if pending.rows:
                self._intake.append(pending.rows, pending.entries)
                if self._rows_since_s is None:
                    self._rows_since_s = pending.first_at_s
                self._rows.extend(pending.rows)
            if pending.waits:
                await session.wait_published(pending.waits)
            session.ack_many(pending.messages)
            self.stats.groups += 1
            if len(self._rows) >= self.config.mapping.batching.max_rows:
                self._seal()

    def _seal(self) -> None:
        """Seal every logged row into the gateway spool (no await: nothing interleaves)."""
        rows = self._rows
        if not rows:
            return
        gateway = self.gateway
        self._intake.seal_begin(gateway.stats().next_seq)
        try:
            self._add(gateway, rows)
        except SpoolError as exc:
            # Back-pressure: the rows stay logged and are offered again at the next seal;
            # meanwhile unacknowledged messages wait in the broker (receive maximum).
            log.warning("adapter %s: %s", self.config.adapter_id, exc)
            return
        self._rows, self._rows_since_s = [], None
        try:
            gateway.flush()
        except SpoolError as exc:  # the gateway holds the rows and seals them later
            log.warning("adapter %s: %s", self.config.adapter_id, exc)
            return
        self._intake.sealed()
        self.stats.rows += len(rows)
        self.stats.seals += 1

    def _add(self, gateway: Gateway, rows: list[Row]) -> None:
        sensor_ids, ts, values, names, types, units = (list(c) for c in zip(*rows, strict=True))
        try:
            gateway.add_many(
                sensor_ids,
                ts,
                values,
                name=names if any(n is not None for n in names) else None,
                type=types if any(t is not None for t in types) else None,
                unit=units if any(u is not None for u in units) else None,
            )
        except SchemaError:
            # The decoders check what the gateway checks; reaching this is a bug in them.
            log.exception("adapter %s: the gateway refused decoded rows", self.config.adapter_id)
            raise
