"""The gateway: measurements in, sealed and spooled batches out, until the pipeline confirms.

Lifecycle: ``Gateway(config)`` opens the spool and recovers its seq; ``start()`` connects
(a self-reconnecting session) and starts the background thread; ``add*`` buffer rows and
seal full batches; ``flush()`` seals the rest; ``close()`` flushes, waits for confirmations
and stops. Unconfirmed batches stay in the spool for the next start.

The order that makes delivery end to end (design §3), per batch:

1. rows are checked against the wire contract when added (``SchemaError`` otherwise);
2. sealing encodes them (split until each payload fits the packet limit), writes the record
   to the spool, *then* raises the spool's seq mark, *then* the seq counts as used;
3. the batch is published QoS 1 in seq order, at most ``max_inflight`` without PUBACK and
   at most ``max_unconfirmed_bytes`` without the pipeline's confirmation (backpressure:
   a backlog waits in the spool, not in the broker's queues);
4. it leaves the spool only when confirmed (``Confirm`` from ``confirm_from``), and is
   re-published after every reconnect, when a combiner reports it missing, and, with
   backoff, when confirmations stall.

Never imports paho: MQTT goes through a ``shoal.broker.session.GatewaySession``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, Self

import numpy.typing as npt
import polars as pl

from shoal.broker import default_gateway_session_factory
from shoal.broker.session import (
    GatewaySession,
    GatewaySessionFactory,
    Message,
    PublishHandle,
    unique_client_id,
)
from shoal.clock import Clock, SystemClock
from shoal.errors import BrokerError, PayloadTooLargeError, SchemaError, ShoalError, SpoolError
from shoal.gateway._batcher import Batcher
from shoal.gateway._blocks import (
    BlockChecker,
    ColumnInput,
    RowBuffer,
    block_from_columns,
    check_row,
)
from shoal.gateway._confirms import ConfirmTracker
from shoal.gateway._outbox import Acked, Outbox
from shoal.gateway._resend import ResendPolicy
from shoal.gateway._sealer import NotStoredError, Sealer
from shoal.gateway._stats import Counters, GatewayStats
from shoal.gateway.config import GatewayConfig
from shoal.gateway.spool import DiskSpool, MemorySpool, Spool, SpoolEntry
from shoal.schemas import DecodeLimits, Measurements
from shoal.schemas.control import Confirm, GatewayStatus

log = logging.getLogger(__name__)

_ROW_CHUNK: Final = 4096
"""Single-row adds are turned into a block every this many rows."""

_SETTLE_S: Final = 0.25
"""After a CONNACK, publishing waits this long: the broker sends the retained confirmations
right after the SUBACK, and a restarted gateway should drop what is already confirmed
instead of re-sending it (or sending a seq the pipeline would drop as a duplicate)."""


class Gateway:
    """Batches measurements, spools them until confirmed, publishes them to the pipeline.

    ``add*`` are thread-safe and never wait for the network: a full batch is sealed into the
    spool in the caller's thread; publishing happens in the background thread (or in
    ``poll()`` when started with ``background=False``).

    Seqs start at 0 for a new spool and continue across restarts without gaps or reuse.

    Args:
        config: what to batch and where to send it.
        clock: time source (batch age, sealed-at stamps, re-send timing, status).
        spool: override the spool ``config.spool_dir`` implies (tests, simulations).
        session_factory: makes its MQTT session (default:
            ``default_gateway_session_factory()``).

    Raises:
        SpoolError: the spool cannot be opened (missing permissions, in use by another
            live gateway).
    """

    def __init__(
        self,
        config: GatewayConfig,
        clock: Clock | None = None,
        *,
        spool: Spool | None = None,
        session_factory: GatewaySessionFactory | None = None,
    ) -> None:
        self.config = config
        self._connect = session_factory or default_gateway_session_factory()
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._spool = spool or self._open_spool(config)
        self._status_topic = config.topics.gateway_status(config.gateway_id)
        self._checker = BlockChecker(DecodeLimits(max_future_ms=config.max_future_ms))
        self._batcher = Batcher(config.batch_size, config.max_delay_ms)
        self._rows = RowBuffer()
        self._n = Counters()
        self._tracker = ConfirmTracker(config.gateway_id, config.confirm_from)
        self._tracker_lock = threading.Lock()  # paho's thread writes, ours reads
        self._outbox = Outbox(
            config.ingest_topic,
            ResendPolicy(
                config.resend_after_ms,
                config.resend_window,
                gap_ms=config.resend_gap_ms,
                jitter=config.resend_jitter,
            ),
            self._spool,
            self._now_ms,
            max_inflight=config.max_inflight,
            max_unconfirmed_bytes=config.max_unconfirmed_bytes,
        )
        self._acked: set[int] = set()  # unconfirmed seqs the broker accepted at least once
        self._sealer = Sealer(
            config,
            self._spool,
            self._clock,
            self._n,
            on_sealed=self._on_sealed,
            on_replaced=self._outbox.drop,
        )
        self._blocked = False  # a seal did not fit the spool: refuse rows until it does
        self._session: GatewaySession | None = None
        self._connections = 0  # bumped on every CONNACK (paho's thread)
        self._seen_connections = 0
        # Up from our on_connect to on_disconnect. The session's own `connected` turns true
        # before on_connect runs; publishing before we handled the connection would skip
        # the settle window and the re-publish of everything unconfirmed.
        self._link_up = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._status_due_s = 0.0
        self._publish_from_s = 0.0
        self._status_handle: PublishHandle | None = None
        self._announced = False
        self._recover()

    # -- public API ------------------------------------------------------------------------

    def start(self, *, background: bool = True) -> Self:
        """Connect to the broker and, with ``background``, start the publishing thread.

        Returns at once; the session connects (and reconnects) in the background. Without
        ``background`` the caller drives everything with ``poll()``.
        """
        with self._lock:
            if self._closed:
                raise ShoalError("the gateway is closed")
            if self._session is not None:
                return self
            self._session = self._connect(
                self.config.broker,
                unique_client_id(f"gw-{self.config.gateway_id}"),
                on_message=self._on_message,
                on_connect=self._on_connect,
                on_disconnect=self._on_disconnect,
                on_acknowledged=self._wake.set,
            )
            self._session.start()
            if background:
                self._thread = threading.Thread(
                    target=self._run, name=f"shoal-gateway-{self.config.gateway_id}", daemon=True
                )
                self._thread.start()
        return self

    def add(
        self,
        sensor_id: str,
        ts_ms: int,
        value: float,
        *,
        name: str | None = None,
        type: str | None = None,  # the research's field name
        unit: str | None = None,
    ) -> None:
        """Add one measurement.

        Raises:
            SchemaError: the row breaks the wire contract (the row is not added).
            SpoolError: the spool is full (the row is not added).
            PayloadTooLargeError: sealing found a measurement too large to send alone.
        """
        attrs = (name, type, unit)
        try:
            ts, val = check_row(sensor_id, ts_ms, value, attrs, self._checker.limits)
            self._check_future(ts)
        except SchemaError:
            with self._lock:
                self._n.rejected += 1
            raise
        with self._lock:
            self._admit(1)
            self._rows.append(sensor_id, ts, val, attrs, self._clock.monotonic())
            self._n.rows_added += 1
            if len(self._rows) >= min(_ROW_CHUNK, self.config.batch_size - self._batcher.rows):
                self._drain_rows()
                self._seal(self._batcher.take_full(), raise_errors=True)

    def add_many(
        self,
        sensor_ids: str | Sequence[str] | npt.NDArray[Any] | pl.Series,
        ts: Sequence[int] | npt.NDArray[Any] | pl.Series,
        values: Sequence[float] | npt.NDArray[Any] | pl.Series,
        *,
        name: ColumnInput = None,
        type: ColumnInput = None,  # the research's field name
        unit: ColumnInput = None,
    ) -> None:
        """Add many measurements from columns (numpy arrays, polars series or sequences).

        ``sensor_ids`` and the attributes may also be one string for every row. Vectorised:
        no per-row Python for arrays. All rows are added, or none.

        Raises:
            SchemaError: some row breaks the wire contract (its row number is named).
            SpoolError: the spool is full.
            PayloadTooLargeError: sealing found a measurement too large to send alone.
        """
        try:
            block = block_from_columns(
                sensor_ids, ts, values, {"name": name, "type": type, "unit": unit}
            )
        except SchemaError:
            with self._lock:
                self._n.rejected += len(values)
            raise
        self.add_block(block)

    def add_block(self, block: Measurements) -> None:
        """Add a block of measurements (the fast path: no conversion, checks vectorised).

        Raises:
            SchemaError: some row breaks the wire contract (no row is added).
            SpoolError: the spool is full (no row is added).
            PayloadTooLargeError: sealing found a measurement too large to send alone.
        """
        if not len(block):
            return
        with self._lock:
            try:
                self._checker.check(block, self._future_now())
            except SchemaError:
                self._n.rejected += len(block)
                raise
            self._admit(len(block))
            self._drain_rows()
            self._batcher.add(block, self._clock.monotonic())
            self._n.rows_added += len(block)
            self._seal(self._batcher.take_full(), raise_errors=True)

    def flush(self) -> None:
        """Seal everything buffered into the spool now.

        Raises:
            SpoolError: it does not fit (the rows stay buffered).
            PayloadTooLargeError: a measurement is too large to send alone (it is dropped).
        """
        with self._lock:
            self._drain_rows()
            self._seal(self._batcher.take_all(), raise_errors=True)
            if self._blocked:
                raise self._full_error(self._batcher.rows)
        self._wake.set()

    def poll(self) -> None:
        """Do one round of background work.

        Seals aged batches, applies confirmations, publishes, re-sends and announces status.
        The background thread calls this; call it yourself when started with
        ``background=False``.
        """
        with self._lock:
            now_s = self._clock.monotonic()
            self._drain_rows()
            self._seal(self._batcher.take_due(now_s), raise_errors=False)
            self._apply_confirms()
            session = self._session
            if session is None or not session.connected or not self._link_up:
                return
            if self._connections != self._seen_connections:
                connections = self._connections
                self._on_new_connection(session)
                self._seen_connections = connections  # only once it worked: else retried
            for acked in self._outbox.collect():
                self._on_acked(acked)
            if now_s < self._publish_from_s:
                return
            with self._tracker_lock:
                missing = self._tracker.missing()
            self._outbox.send(
                session,
                first_unconfirmed=self._confirmed + 1,
                next_seq=self._sealer.next_seq,
                fit=self._fit,
                missing=missing,
            )
            if now_s >= self._status_due_s:
                self._publish_status(session)

    def wait_confirmed(self, timeout_s: float) -> bool:
        """Wait until every sealed batch is confirmed; False if ``timeout_s`` passes first.

        ``timeout_s`` is measured on the gateway's clock (a ``FakeClock`` must be advanced).
        """
        deadline = self._clock.monotonic() + timeout_s
        with self._changed:
            while not self._all_confirmed():
                remaining = deadline - self._clock.monotonic()
                if remaining <= 0:
                    return False
                if self._thread is None:
                    self.poll()
                    if self._all_confirmed():
                        break
                self._changed.wait(min(remaining, 0.02))
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Flush, wait up to ``timeout_s`` for confirmations, publish a last status, stop.

        Returns whether every batch was confirmed; those that were not stay in the spool
        and are sent again by the next gateway started on it.

        Raises:
            SpoolError: the final flush did not fit the spool (after stopping).
        """
        if self._closed:
            return self._all_confirmed()
        error: ShoalError | None = None
        try:
            self.flush()
        except ShoalError as exc:
            error = exc
        confirmed = self._all_confirmed()
        if self._session is not None and not confirmed:
            confirmed = self.wait_confirmed(timeout_s)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            session = self._session
            handle = None
            if session is not None and session.connected:
                handle = self._publish_status(session)
            self._closed = True
        if handle is not None:
            handle.wait(1.0)
        if session is not None:
            session.stop()
        with self._lock:
            self._spool.close()
        if error is not None:
            raise error
        return confirmed

    def stats(self) -> GatewayStats:
        """A snapshot of the counters."""
        with self._lock:
            n = self._n
            return GatewayStats(
                rows_added=n.rows_added,
                rows_buffered=self._batcher.rows + len(self._rows),
                rows_sealed=n.rows_sealed,
                rows_published=n.rows_published,
                bytes_published=n.bytes_published,
                batches_sealed=n.batches_sealed,
                batches_published=n.batches_published,
                publishes=self._outbox.publishes,
                resends=self._outbox.resends,
                batches_confirmed=n.batches_confirmed,
                next_seq=self._sealer.next_seq,
                confirmed_seq=self._confirmed,
                spool_batches=len(self._spool),
                spool_bytes=self._spool.bytes_used,
                splits=n.splits,
                rejected=n.rejected,
                connected=self._link_up and self._session is not None and self._session.connected,
            )

    def status(self) -> GatewayStatus:
        """What the gateway announces on its status topic."""
        with self._lock:
            first = self._spool.get(self._confirmed + 1)
            return GatewayStatus(
                gateway_id=self.config.gateway_id,
                stream=self.config.stream,
                next_seq=self._sealer.next_seq,
                first_unconfirmed_seq=self._confirmed + 1,
                unconfirmed_batches=len(self._spool),
                unconfirmed_rows=self._spool.rows_held,
                oldest_unconfirmed_ms=first.sealed_at_ms if first is not None else None,
                spool_bytes=self._spool.bytes_used,
                rows_total=self._n.rows_sealed,
                at_ms=self._clock.now_ms(),
            )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- recovery ---------------------------------------------------------------------------

    @staticmethod
    def _open_spool(config: GatewayConfig) -> Spool:
        if config.spool_dir is None:
            return MemorySpool(config.max_spool_bytes)
        return DiskSpool(
            config.spool_dir, max_bytes=config.max_spool_bytes, fsync=config.spool_fsync
        )

    def _recover(self) -> None:
        """Derive the seq state from the spool; repair what a crash may have left behind."""
        spool = self._spool
        held = [e.seq for e in spool.entries()] + spool.damaged
        # Everything below the lowest record was confirmed and deleted.
        self._confirmed = (min(held) if held else self._sealer.next_seq) - 1
        self._sealer.fill_holes(held)
        self._sealer.finish_reseals()
        self._outbox.sent_before(e.seq for e in spool.entries())
        if len(spool):
            log.info(
                "gateway %s: %d unconfirmed batches in the spool (seq %d..%d); next seq %d",
                self.config.gateway_id,
                len(spool),
                self._confirmed + 1,
                self._sealer.next_seq - 1,
                self._sealer.next_seq,
            )

    # -- input -------------------------------------------------------------------------------

    def _future_now(self) -> int | None:
        return self._clock.now_ms() if self.config.max_future_ms is not None else None

    def _check_future(self, ts: int) -> None:
        limit = self.config.max_future_ms
        if limit is not None and ts > self._clock.now_ms() + limit:
            raise SchemaError(
                "timestamp too far in the future",
                reason="ts_in_future",
                field="ts",
                expected=f"at most {limit} ms after the gateway's clock ({self._clock.now_ms()})",
                found=str(ts),
            )

    def _admit(self, rows: int) -> None:
        """Refuse rows while the spool cannot take the batches already waiting."""
        if self._blocked:
            self._seal(self._batcher.take_due(self._clock.monotonic()), raise_errors=False)
        if self._blocked or self._spool.free_bytes() == 0:
            self._n.rejected += rows
            raise self._full_error(rows)

    def _full_error(self, rows: int) -> SpoolError:
        return SpoolError(
            f"the spool of gateway {self.config.gateway_id} is full "
            f"({self._spool.bytes_used} of {self._spool.max_bytes} bytes in {len(self._spool)} "
            f"unconfirmed batches): {rows} rows were not accepted. Wait for the pipeline to "
            "confirm (is it running and subscribed?) or raise max_spool_bytes"
        )

    def _drain_rows(self) -> None:
        taken = self._rows.take()
        if taken is not None:
            self._batcher.add(*taken)

    # -- sealing -------------------------------------------------------------------------------

    def _seal(self, items: list[tuple[Measurements, float]], *, raise_errors: bool) -> None:
        """Seal blocks into the spool in order; what does not fit goes back to the batcher."""
        too_large: PayloadTooLargeError | None = None
        for index, (block, arrived_s) in enumerate(items):
            try:
                self._sealer.seal(block)
            except NotStoredError as exc:
                if not self._blocked:
                    log.warning("gateway %s: %s", self.config.gateway_id, exc.error)
                self._blocked = True
                for rest, rest_at in reversed(items[index + 1 :]):
                    self._batcher.push_front(rest, rest_at)
                self._batcher.push_front(exc.rows, arrived_s)
                break
            except PayloadTooLargeError as exc:
                too_large = exc
        else:
            if items:
                self._blocked = False
        if too_large is not None:
            if raise_errors:
                raise too_large
            log.error("gateway %s: %s", self.config.gateway_id, too_large)

    # -- confirmations -------------------------------------------------------------------------

    def _all_confirmed(self) -> bool:
        return self._confirmed >= self._sealer.next_seq - 1

    def _on_message(self, message: Message) -> None:
        """Paho's thread: fold a confirmation into the tracker, wake the publisher."""
        if not message.payload:
            return  # a retained confirm being cleared
        try:
            confirm = Confirm.from_json(message.payload)
        except SchemaError as exc:
            log.warning(
                "gateway %s: ignoring a bad confirmation on %s: %s",
                self.config.gateway_id,
                message.topic,
                exc,
            )
            return
        with self._tracker_lock:
            changed = self._tracker.update(confirm)
        if changed:
            self._wake.set()

    def _apply_confirms(self) -> None:
        if self.config.release_on_puback:
            return
        with self._tracker_lock:
            confirmed = self._tracker.confirmed_seq()
        if confirmed <= self._confirmed:
            return
        if confirmed >= self._sealer.next_seq:
            self._adopt_foreign_confirm(confirmed)
        self._advance(confirmed)

    def _adopt_foreign_confirm(self, confirmed: int) -> None:
        """Continue above a confirmation for seqs this gateway never sealed.

        Its spool was lost, or another gateway used this id. New batches at or below that seq
        would be dropped as duplicates, so continue above it, re-sealing what we hold under
        fresh seqs.
        """
        log.warning(
            "gateway %s: the pipeline confirms seq %d but the next seq here is %d (spool lost, "
            "or another gateway with this id?); continuing at %d",
            self.config.gateway_id,
            confirmed,
            self._sealer.next_seq,
            confirmed + 1,
        )
        held = [e for e in self._spool.entries() if e.rows > 0]
        self._sealer.skip_to(confirmed)
        for entry in held:
            self._sealer.reseal(entry)

    def _advance(self, confirmed: int) -> None:
        """Everything up to ``confirmed`` is confirmed: drop it from the spool."""
        gone = self._spool.delete_through(confirmed)
        self._confirmed = confirmed
        self._n.batches_confirmed += len(gone)
        for entry in gone:
            if entry.seq not in self._acked:  # confirmed before its PUBACK was collected
                self._n.batches_published += 1
                self._n.rows_published += entry.rows
                self._n.bytes_published += entry.payload_bytes
            self._acked.discard(entry.seq)
        self._outbox.confirmed(confirmed)
        if self._blocked:  # room again: seal what waited
            self._seal(self._batcher.take_due(self._clock.monotonic()), raise_errors=False)
        self._status_due_s = min(self._status_due_s, self._clock.monotonic() + 0.1)
        self._changed.notify_all()

    # -- publishing --------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock.monotonic() * 1000)

    def _on_connect(self, session: GatewaySession) -> None:
        """Paho's thread, after every CONNACK: (re)subscribe, let the publisher catch up."""
        session.subscribe(self.config.topics.confirm_filter(self.config.gateway_id), qos=1)
        with self._tracker_lock:
            self._connections += 1
            self._link_up = True
        self._wake.set()

    def _on_disconnect(self) -> None:
        """Paho's thread: the connection is gone."""
        with self._tracker_lock:
            self._link_up = False
        self._wake.set()

    def _on_new_connection(self, session: GatewaySession) -> None:
        limit = self.config.payload_limit(session.max_packet_size)
        shrunk = limit < self._sealer.payload_limit
        self._sealer.payload_limit = limit
        if shrunk:
            for entry in self._spool.entries():
                if entry.payload_bytes > limit and entry.seq > self._confirmed:
                    self._sealer.reseal(entry)
        self._outbox.reconnected(self._confirmed + 1)
        self._publish_from_s = self._clock.monotonic() + _SETTLE_S
        self._status_due_s = self._publish_from_s

    def _on_sealed(self, seq: int, payload: bytes) -> None:
        self._outbox.sealed(seq, payload)
        self._wake.set()

    def _on_acked(self, acked: Acked) -> None:
        seq = acked.seq
        if seq in self._acked or seq <= self._confirmed:
            return  # counted already (at its first PUBACK, or when it was confirmed)
        self._acked.add(seq)
        self._n.batches_published += 1
        self._n.rows_published += acked.rows
        self._n.bytes_published += acked.payload_bytes
        if self.config.release_on_puback:
            confirmed = self._confirmed
            while confirmed + 1 in self._acked:
                confirmed += 1
            if confirmed > self._confirmed:
                self._advance(confirmed)

    def _fit(self, entry: SpoolEntry) -> SpoolEntry:
        """The batch to send for ``entry``: re-sealed first if over the packet limit.

        Reconnects re-seal oversized batches already; this catches any that slipped through.
        """
        if entry.payload_bytes <= self._sealer.payload_limit:
            return entry
        self._sealer.reseal(entry)
        refit = self._spool.get(entry.seq)
        assert refit is not None
        return refit

    def _publish_status(self, session: GatewaySession) -> PublishHandle | None:
        self._status_due_s = self._clock.monotonic() + self.config.status_interval_ms / 1000.0
        try:
            handle = session.publish(
                self._status_topic, self.status().to_json(), qos=1, retain=True
            )
        except BrokerError as exc:
            log.debug("gateway %s: status not published: %s", self.config.gateway_id, exc)
            return None
        self._status_handle = handle
        return handle

    def announced(self) -> bool:
        """Whether the broker has acknowledged a status of this gateway.

        From then on combiners know the gateway and hold their windows for its batches: a
        gateway that starts sending before it is announced may find the first windows closed
        by others' progress (its rows are then late).
        """
        if not self._announced:
            handle = self._status_handle
            self._announced = handle is not None and handle.is_acknowledged()
        return self._announced

    # -- background thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except ShoalError as exc:
                log.error("gateway %s: %s", self.config.gateway_id, exc)  # noqa: TRY400 - expected, no traceback
            except Exception:
                log.exception("gateway %s: background work failed", self.config.gateway_id)
            self._wake.wait(self._idle_s())
            self._wake.clear()

    def _idle_s(self) -> float:
        """How long the background thread may sleep before something needs doing."""
        wait = 0.05  # PUBACKs wake us (on_acknowledged); this bounds the wait otherwise
        with self._lock:
            deadline = self._batcher.deadline_s()
            if self._rows.first_at_s is not None:
                row_deadline = self._rows.first_at_s + self.config.max_delay_ms / 1000.0
                deadline = row_deadline if deadline is None else min(deadline, row_deadline)
            now = self._clock.monotonic()
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            return min(wait, max(0.0, self._status_due_s - now))
