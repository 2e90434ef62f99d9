"""Sealing: blocks become spooled batches with consecutive seqs, split to fit the packet limit.

Owns the gateway's seq counter. The order that keeps seqs gap-free and never reused: encode
(``seal_block`` assigns seqs only to parts that fit), write the records to the spool, *then*
raise the spool's mark, *then* count the seqs as used. Also repairs what a crash left in the
spool (holes, interrupted re-seals). Never imports the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from shoal.clock import Clock
from shoal.errors import PayloadTooLargeError, SpoolError
from shoal.gateway._blocks import concat_blocks, empty_block
from shoal.gateway._seal import Part, Sealed, seal_block
from shoal.gateway._stats import Counters
from shoal.gateway.config import GatewayConfig
from shoal.gateway.spool import Spool, SpoolEntry
from shoal.schemas import DecodeLimits, Measurements, decode_batch, encode_batch

log = logging.getLogger(__name__)

_RESEAL_LIMITS: Final = DecodeLimits(
    max_payload_bytes=1 << 28, max_decompressed_bytes=1 << 31, max_future_ms=None
)
"""Reading back our own spooled batches: our limits, not a worker's."""


class NotStoredError(SpoolError):
    """Sealed parts that did not reach the spool; their rows go back to the batcher.

    A ``SpoolError`` (``error`` is the spool's own) that also carries the rows; it lives here
    rather than in ``shoal.errors`` because it holds ``Measurements``.
    """

    def __init__(self, error: SpoolError, rows: Measurements) -> None:
        super().__init__(str(error))
        self.error = error
        self.rows = rows


class Sealer:
    """Seals blocks into the spool and owns the next seq.

    Args:
        config: the gateway's configuration (id, encoding, packet limit).
        spool: where batches go.
        clock: sealed-at stamps.
        counters: the gateway's counters (batches and rows sealed, splits, rejected).
        on_sealed: told of every stored batch (seq, payload), to publish it.
        on_replaced: told when a stored batch was replaced by an empty one (seq).
    """

    def __init__(
        self,
        config: GatewayConfig,
        spool: Spool,
        clock: Clock,
        counters: Counters,
        *,
        on_sealed: Callable[[int, bytes], None],
        on_replaced: Callable[[int], None],
    ) -> None:
        self._config = config
        self._spool = spool
        self._clock = clock
        self._n = counters
        self._on_sealed = on_sealed
        self._on_replaced = on_replaced
        self.next_seq = spool.high_water + 1
        """The seq the next batch gets: one past the spool's mark or highest record."""
        self.payload_limit = config.payload_limit(None)
        """Largest payload sent; lowered by the broker's CONNACK limit."""

    def skip_to(self, seq: int) -> None:
        """Never use seqs up to ``seq`` (the pipeline already confirmed them)."""
        self._spool.raise_mark(seq)
        self.next_seq = max(self.next_seq, seq + 1)

    def fill_holes(self, held: list[int]) -> None:
        """Turn holes in the spool into empty batches.

        Records between the lowest held one and the mark must all exist: a combiner waits
        for every seq. Holes (a damaged record, power loss without fsync, a file deleted by
        hand) become empty batches; their rows are lost, and we say so.
        """
        if not held:
            return
        missing = [s for s in range(min(held), self.next_seq) if self._spool.get(s) is None]
        if missing:
            log.error(
                "gateway %s: spool records for %d seqs (%s..%s) are missing or damaged; "
                "publishing them as empty batches so confirmations stay contiguous "
                "(their measurements are lost: use spool_fsync=True to survive power loss)",
                self._config.gateway_id,
                len(missing),
                missing[0],
                missing[-1],
            )
        for seq in missing:
            payload = self._encode(empty_block(), seq, self._clock.now_ms())
            entry = SpoolEntry(seq, self._content_type, 0, len(payload), self._clock.now_ms())
            self._spool.replace(entry, payload)

    def finish_reseals(self) -> None:
        """Complete re-seals a crash interrupted.

        Parts were written, the old record not yet replaced by its empty batch; ``_reseal``
        carries on where the parts stop.
        """
        sources = {e.resealed_from[0] for e in self._spool.entries() if e.resealed_from}
        for source in sorted(sources):
            old = self._spool.get(source)
            if old is not None and old.rows > 0:
                log.warning(
                    "gateway %s: finishing the re-seal of seq %d", self._config.gateway_id, source
                )
                self.reseal(old)

    @property
    def _content_type(self) -> str:
        return self._config.encoding.content_type

    def _encode(self, block: Measurements, seq: int, now_ms: int) -> bytes:
        return encode_batch(
            block,
            gateway_id=self._config.gateway_id,
            seq=seq,
            sent_at_ms=now_ms,
            encoding=self._config.encoding,
            zstd=self._config.zstd,
        )

    def seal(self, block: Measurements) -> None:
        now_ms = self._clock.now_ms()
        sealed = seal_block(
            block,
            first_seq=self.next_seq,
            limit_bytes=self.payload_limit,
            encode=lambda b, seq: self._encode(b, seq, now_ms),
        )
        self._store(sealed, now_ms, block, resealed_from=None)

    def _store(
        self,
        sealed: Sealed,
        now_ms: int,
        block: Measurements,
        *,
        resealed_from: tuple[int, int] | None,
    ) -> None:
        """Write sealed parts to the spool, then count their seqs as used.

        Raises:
            NotStoredError: the spool refused some parts (those before stay: their seqs are used).
            PayloadTooLargeError: some rows did not fit a packet alone (they were dropped).
        """
        records = []
        for part in sealed.parts:
            origin = None
            if resealed_from is not None:
                source, offset = resealed_from
                origin = (source, offset + part.row_start, offset + part.row_stop)
            entry = SpoolEntry(
                part.seq, self._content_type, part.rows, len(part.payload), now_ms, origin
            )
            records.append((entry, part.payload))
        try:
            self._spool.put(records, check_capacity=resealed_from is None)
        except SpoolError as exc:
            written = [p for p in sealed.parts if self._spool.get(p.seq) is not None]
            unsealed = [p for p in sealed.parts if self._spool.get(p.seq) is None]
            self._register(written, fresh=resealed_from is None)
            rows = concat_blocks([block.slice(p.row_start, p.row_stop) for p in unsealed])
            raise NotStoredError(exc, rows) from exc
        self._register(sealed.parts, fresh=resealed_from is None)
        self._n.splits += sealed.splits
        if sealed.too_large:
            self._n.rejected += len(sealed.too_large)
            row = sealed.too_large[0]
            sensor = block.sensor_id.values[int(block.sensor_id.codes[row])]
            raise PayloadTooLargeError(
                f"gateway {self._config.gateway_id}: {len(sealed.too_large)} measurement(s) "
                f"(the first of sensor {sensor!r}) do not fit a packet of "
                f"{self.payload_limit} payload bytes even alone; they were dropped. Raise "
                "max_packet_bytes and the broker's max_packet_size, or shorten the strings"
            )

    def _register(self, parts: Sequence[Part], *, fresh: bool) -> None:
        """Count stored parts (``fresh``: new rows, not a re-seal of spooled ones)."""
        for part in parts:
            self.next_seq = max(self.next_seq, part.seq + 1)
            self._n.batches_sealed += 1
            if fresh:
                self._n.rows_sealed += part.rows
            self._on_sealed(part.seq, part.payload)

    def reseal(self, entry: SpoolEntry) -> None:
        """Re-cut a spooled batch into new batches with fresh seqs.

        Used when it no longer fits the packet limit, or its seq is no longer usable. The old
        record is then replaced by an empty batch so the sequence stays contiguous.

        Parts name their origin and rows, so a crash (or a failed write) in between is
        finished later from where the parts stop, instead of duplicating rows.

        A batch that a previous connection already delivered may then count twice (once
        whole, once in parts); this only happens when a broker's packet limit is lowered
        below batches already sent, which the pipeline cannot tell from new data.
        """
        now_ms = self._clock.now_ms()
        start_row = max(
            (
                e.resealed_from[2]
                for e in self._spool.entries()
                if e.resealed_from is not None and e.resealed_from[0] == entry.seq
            ),
            default=0,
        )
        payload = self._spool.read(entry.seq)
        batch = decode_batch(payload, content_type=entry.content_type, limits=_RESEAL_LIMITS)
        block = Measurements.from_frame(batch.frame).slice(start_row, batch.frame.height)
        if len(block):
            sealed = seal_block(
                block,
                first_seq=self.next_seq,
                limit_bytes=self.payload_limit,
                encode=lambda b, seq: self._encode(b, seq, now_ms),
            )
            try:
                self._store(sealed, now_ms, block, resealed_from=(entry.seq, start_row))
            except PayloadTooLargeError as exc:
                log.warning("gateway %s: %s", self._config.gateway_id, exc)
            except NotStoredError as exc:
                raise exc.error from exc  # the old batch stays whole; retried later
        empty = self._encode(empty_block(), entry.seq, now_ms)
        self._spool.replace(SpoolEntry(entry.seq, self._content_type, 0, len(empty), now_ms), empty)
        self._on_replaced(entry.seq)
        log.warning(
            "gateway %s: re-sealed batch %d (%d rows, %d bytes) into seqs up to %d",
            self._config.gateway_id,
            entry.seq,
            entry.rows,
            entry.payload_bytes,
            self.next_seq - 1,
        )
