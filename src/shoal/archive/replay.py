"""Replay archived raw batches through a pipeline spec offline: no broker, the same code.

``replay`` decodes every archived batch with ``decode_batch`` (the exact bytes and content type
a worker saw), builds partials with ``PartialBuilder`` and feeds them to one ``Combiner`` per
partition, on a ``FakeClock`` that never moves. The steps mirror a worker and a combiner:

1. keep batches whose topic matches the spec's inputs; a batch whose envelope cannot be read,
   or names another gateway than its topic, is skipped (workers dead-letter it without
   marking any seq); re-sends are dropped on ``(gateway, seq)``, keeping the first received;
2. announce every gateway with a status whose first seq is its first archived seq, so each
   gateway starts there and every gateway holds the watermark until it has data;
3. feed batches per gateway in seq order (gateways interleaved by receive time); a hole in a
   gateway's archived sequence is skipped with a status (reported in ``gaps``); a batch that
   fails to decode is marked handled with empty "rejected" partials, as a worker does;
4. after each batch, close what the watermark allows, as a combiner does; at the end,
   ``Combiner.flush`` closes every open window.

Because the clock never moves, no gateway ever goes idle, and a window closes only once
*every* gateway's own data is ``lateness_ms`` past its end. A row that counts as late here
is then behind its own gateway's watermark, which is exactly the per-gateway rule the live
combiner applies; so every window the live pipeline emitted is emitted here with the same
keys and counts, and values equal up to float summation order. The one live case replay
cannot reproduce is timing: rows a live combiner reported late as ``window_closed`` (an idle
gateway returning after its windows closed) count here.

Results come back in the result layout of ``shoal.schemas.results``: each closed window is
rendered as the JSON message a combiner would publish and parsed back as the client does.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import polars as pl

from shoal.archive.read import read_batches
from shoal.clock import FakeClock
from shoal.errors import InputError
from shoal.processors.combine import Combiner, LateRows, Step
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.results import Emission, split_windows, window_json
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import ClosedWindows
from shoal.schemas import decode_batch
from shoal.schemas.control import GatewayStatus
from shoal.schemas.results import empty_results, latest_revisions, parse_window_message
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)

REPLAY_WORKER: Final = "replay"


@dataclass
class ReplayReport:
    """What a replay read and did.

    Attributes:
        batches_archived: archived batches matching the spec's inputs (re-sends included).
        batches_applied: distinct (gateway, seq) fed to the combiners.
        duplicates: re-sent copies dropped.
        unreadable: batches without a readable (gateway, seq) for their topic (skipped).
        rejected: batches that failed to decode (dead-lettered live; marked handled here).
        gaps: per gateway, ``(first, last)`` seq ranges missing from the archive.
        rows_applied: measurements counted in windows.
        rows_late: measurements reported late.
        windows: (window, start) pairs emitted.
    """

    batches_archived: int = 0
    batches_applied: int = 0
    duplicates: int = 0
    unreadable: int = 0
    rejected: int = 0
    gaps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    rows_applied: int = 0
    rows_late: int = 0
    windows: int = 0


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """The outcome of a replay.

    Attributes:
        results: every emitted window's rows, result layout, sorted by end, window, start, key.
        late: late rows (``gateway_id``, ``seq`` and the ``LateRows`` columns).
        report: counts.
    """

    results: pl.DataFrame
    late: pl.DataFrame
    report: ReplayReport


@dataclass(frozen=True, slots=True)
class _Batch:
    received_at: int
    stream: str
    gateway_id: str
    seq: int
    content_type: str | None
    payload: bytes


def replay(
    spec: PipelineSpec,
    batches: pl.DataFrame | Path,
    *,
    start_ms: int | None = None,
    end_ms: int | None = None,
) -> ReplayResult:
    """Run ``spec`` over archived raw batches (see the module docstring).

    Args:
        spec: the pipeline, as the live workers and combiners ran it.
        batches: an archive folder, or a frame from ``read_batches``.
        start_ms: only batches received at or after this (archive folders only).
        end_ms: only batches received before this (archive folders only).
    """
    frame = (
        read_batches(batches, start_ms=start_ms, end_ms=end_ms)
        if isinstance(batches, Path)
        else batches
    )
    report = ReplayReport()
    queues = _per_gateway(spec, frame, report)
    clock = FakeClock(int(frame["received_at"].min()) if frame.height else 0)  # type: ignore[arg-type]
    run = _Run(spec, clock, report)
    for gateway_id, queue in queues.items():
        run.announce(gateway_id, queue)
    for batch in _interleave(queues):
        run.feed(batch)
    run.finish()
    return ReplayResult(run.results(), run.late_frame(), report)


def _per_gateway(
    spec: PipelineSpec, frame: pl.DataFrame, report: ReplayReport
) -> dict[str, list[_Batch]]:
    """Matching, readable, first-received copy of each (gateway, seq), per gateway by seq."""
    topics = Topics()
    queues: dict[str, dict[int, _Batch]] = {}
    columns = ("received_at", "stream", "topic", "gateway_id", "seq", "content_type", "payload")
    for received_at, stream, topic, gateway_id, seq, content_type, payload in frame.select(
        columns
    ).iter_rows():
        if not any(topic_matches(f, topic) for f in spec.inputs):
            continue
        report.batches_archived += 1
        route = topics.ingest_gateway(topic)
        if (
            route is None
            or seq is None
            or gateway_id != route[1]
            or len(payload) > spec.limits.max_payload_bytes
        ):
            report.unreadable += 1
            continue
        seen = queues.setdefault(gateway_id, {})
        if seq in seen:
            report.duplicates += 1
            continue
        seen[seq] = _Batch(received_at, stream or route[0], gateway_id, seq, content_type, payload)
    return {g: [seen[s] for s in sorted(seen)] for g, seen in sorted(queues.items())}


def _interleave(queues: dict[str, list[_Batch]]) -> Iterator[_Batch]:
    """Every gateway's batches in seq order, gateways merged by receive time."""
    return heapq.merge(*queues.values(), key=lambda b: (b.received_at, b.gateway_id, b.seq))


class _Run:
    """One replay's builder, combiners and collected output."""

    def __init__(self, spec: PipelineSpec, clock: FakeClock, report: ReplayReport) -> None:
        self.spec = spec
        self.clock = clock
        self.report = report
        self.builder = PartialBuilder(spec, REPLAY_WORKER)
        self.combiners = [Combiner(spec, p, clock, logged=False) for p in range(spec.partitions)]
        self.expected: dict[str, int] = {}
        self.streams: dict[str, str] = {}
        self.messages: list[bytes] = []
        self.late: list[LateRows] = []

    def _status(self, gateway_id: str, first: int, next_seq: int) -> GatewayStatus:
        return GatewayStatus(
            gateway_id=gateway_id,
            stream=self.streams[gateway_id],
            next_seq=next_seq,
            first_unconfirmed_seq=first,
            unconfirmed_batches=next_seq - first,
            unconfirmed_rows=0,
            oldest_unconfirmed_ms=None,
            spool_bytes=0,
            rows_total=0,
            at_ms=self.clock.now_ms(),
        )

    def announce(self, gateway_id: str, queue: list[_Batch]) -> None:
        """Start the gateway at its first archived seq; note holes in its sequence."""
        self.streams[gateway_id] = queue[0].stream
        first, last = queue[0].seq, queue[-1].seq
        self.expected[gateway_id] = first
        gaps = [(a.seq + 1, b.seq - 1) for a, b in itertools.pairwise(queue) if b.seq > a.seq + 1]
        if gaps:
            self.report.gaps[gateway_id] = gaps
            log.warning("replay: gateway %s misses seqs %s in the archive", gateway_id, gaps)
        status = self._status(gateway_id, first, last + 1)
        for combiner in self.combiners:
            self._take(combiner, combiner.receive_status(status))

    def feed(self, batch: _Batch) -> None:
        """Decode, build partials, hand them to their partitions, close what can close."""
        if batch.seq > self.expected[batch.gateway_id]:  # a hole in the archive: skip it
            status = self._status(batch.gateway_id, batch.seq, batch.seq + 1)
            for combiner in self.combiners:
                self._take(combiner, combiner.receive_status(status))
        self.expected[batch.gateway_id] = batch.seq + 1
        info = BatchInfo(
            gateway_id=batch.gateway_id,
            seq=batch.seq,
            stream=batch.stream,
            rows=0,
            min_ts=None,
            max_ts=None,
            sent_at_ms=0,
            received_at_ms=batch.received_at,
            worker=REPLAY_WORKER,
        )
        now = self.clock.now_ms()
        try:
            decoded = decode_batch(
                batch.payload,
                content_type=batch.content_type,
                limits=self.spec.limits,
                now_ms=batch.received_at,
            )
            if decoded.envelope.gateway_id != batch.gateway_id:
                self.report.unreadable += 1
                return
            partials = self.builder.build_batch(decoded, info, now)
        except InputError as exc:
            self.report.rejected += 1
            rejected = replace(info, status="rejected", reason=exc.reason)
            partials = self.builder.rejected(rejected, now)
        self.report.batches_applied += 1
        for partial in partials:
            combiner = self.combiners[partial.partition]
            self._take(combiner, combiner.receive(partial))
            self._emit(combiner, combiner.close_ready(now))

    def finish(self) -> None:
        """Close every open window."""
        for combiner in self.combiners:
            self._emit(combiner, combiner.flush())
        self.report.rows_applied = sum(c.counters.rows_applied for c in self.combiners)
        self.report.rows_late = sum(c.counters.rows_late for c in self.combiners)

    def _take(self, combiner: Combiner, step: Step) -> None:
        self.late.extend(step.late)
        self._emit(combiner, step.closed)

    def _emit(self, combiner: Combiner, closed: ClosedWindows | None) -> None:
        if closed is None or closed.empty:
            return
        ctx = Emission(
            self.spec.name,
            combiner.partition,
            self.spec.partitions,
            combiner.closed_through,
            self.clock.now_ms(),
        )
        self.messages.extend(
            window_json(result, ctx)
            for result in split_windows(closed.frame, closed.revisions, closed.sessions)
        )

    def results(self) -> pl.DataFrame:
        """Every emitted window (its latest revision), parsed as the client parses live ones."""
        frames = [parse_window_message(m, "application/json").frame for m in self.messages]
        if not frames:
            return empty_results(self.spec.aggregate_names)
        out = latest_revisions(pl.concat(frames, how="diagonal_relaxed"))
        self.report.windows = out.select("window", "start").unique().height
        return out.sort("end", "window", "start", "key", nulls_last=True)

    def late_frame(self) -> pl.DataFrame:
        """Late rows with their gateway and seq."""
        frames = [
            late.frame.with_columns(
                pl.lit(late.gateway_id).alias("gateway_id"),
                pl.lit(late.seq, dtype=pl.Int64).alias("seq"),
            )
            for late in self.late
        ]
        if not frames:
            return pl.DataFrame(
                schema={"gateway_id": pl.String(), "seq": pl.Int64(), "rows": pl.Int64()}
            )
        return pl.concat(frames, how="diagonal_relaxed")
