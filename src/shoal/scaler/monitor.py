"""A pipeline seen from the outside: rates, workers, lag, results, dead letters, late rows.

``PipelineMonitor`` is fed the messages a pipeline publishes (gateway status, confirmations,
component heartbeats, results, late rows, dead letters) and turns them into a ``Snapshot``.
It does no I/O and takes time from a ``Clock``; ``shoal up`` renders it, the scaler reads
its lag, benchmarks read its counters.

Lag, exactly (design §4): for every gateway, ``last published seq - highest seq confirmed by
every partition of this pipeline`` batches, and the gateway's own count of unconfirmed
measurements, plus the age of its oldest unconfirmed batch. Like Kafka's log-end offset
minus the committed offset, both ends are announced by the parties that know them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from shoal.broker.session import Message
from shoal.clock import Clock
from shoal.errors import SchemaError
from shoal.processors.results import late_memberships
from shoal.processors.spec import PipelineSpec
from shoal.schemas.control import Confirm, GatewayStatus
from shoal.schemas.topics import Topics

HEARTBEAT_TIMEOUT_MS: Final = 3_000
RATE_WINDOW_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class GatewayLag:
    """Lag of one gateway for this pipeline."""

    gateway_id: str
    last_seq: int
    confirmed_seq: int
    batches: int
    rows: int
    oldest_age_ms: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The pipeline at one moment.

    Attributes:
        at_ms: clock time of the snapshot.
        rows_in_per_s: measurements sealed by gateways per second (recent).
        rows_out_per_s: measurements applied by combiners per second (recent).
        workers: live workers (heartbeat within the timeout), by id: pinned to this
            pipeline, or pool workers whose ``serving`` lists it.
        lag: per-gateway lag.
        lag_batches: total batches published but not confirmed.
        lag_rows: total measurements in them.
        oldest_unconfirmed_age_ms: age of the oldest unconfirmed batch (None: none).
        rows_generated: measurements sealed by all gateways (status ``rows_total``).
        batch_rows_applied: measurements of applied batches (combiner partition 0).
        windows_emitted: window result messages received.
        rows_in_results: measurements counted by window results of the first window spec.
        deadletters: dead-lettered messages seen.
        late_rows: late measurements reported (for the first window spec).
        window_memberships: (row, window) pairs of the first window spec counted in results
            or reported late: ``windows_per_row`` for every applied measurement, exactly.
        windows_per_row: how many windows of the first window spec each row falls into.
        latest: latest result per key (a few keys), newest first.
        combiners: latest heartbeat per combiner partition.
        worker_metrics: latest heartbeat per live worker.
    """

    at_ms: int
    rows_in_per_s: float
    rows_out_per_s: float
    workers: tuple[str, ...]
    lag: tuple[GatewayLag, ...]
    lag_batches: int
    lag_rows: int
    oldest_unconfirmed_age_ms: int | None
    rows_generated: int
    batch_rows_applied: int
    windows_emitted: int
    rows_in_results: int
    deadletters: int
    late_rows: int
    window_memberships: int
    windows_per_row: int
    latest: tuple[dict[str, Any], ...]
    combiners: dict[int, dict[str, Any]]
    worker_metrics: dict[str, dict[str, Any]]


@dataclass
class _Rate:
    """A counter's rate over a sliding window of (time, value) samples."""

    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))

    def add(self, at_s: float, value: int) -> None:
        self.samples.append((at_s, value))

    def per_second(self, now_s: float) -> float:
        recent = [(t, v) for t, v in self.samples if now_s - t <= RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0
        # A restarted gateway may count from zero again: that is no negative arrival.
        return max(0.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]))


class PipelineMonitor:
    """Folds a pipeline's published messages into snapshots (see the module docstring)."""

    def __init__(
        self, spec: PipelineSpec, topics: Topics, clock: Clock, latest_keys: int = 5
    ) -> None:
        self.spec = spec
        self.topics = topics
        self.clock = clock
        self.latest_keys = latest_keys
        self.status: dict[str, GatewayStatus] = {}
        self._status_seen_ms: dict[str, int] = {}
        self.confirms: dict[str, dict[int, int]] = {}
        self.workers: dict[str, tuple[int, dict[str, Any]]] = {}
        self.combiners: dict[int, dict[str, Any]] = {}
        self.windows_emitted = 0
        self.deadletters = 0
        # Tallies over the first window spec, in (row, window) memberships: a hopping window
        # counts every row once per window it falls into.
        self._result_members = 0
        self._late_members = 0
        self.latest: dict[str, dict[str, Any]] = {}
        self._in: dict[str, _Rate] = {}  # per gateway: their reports interleave
        self._out = _Rate()
        self._first_window = spec.windows[0].name
        self._per_row = spec.windows[0].windows_per_row

    def filters(self) -> list[str]:
        """Topic filters to subscribe to."""
        name = self.spec.name
        t = self.topics
        return [
            t.gateway_status_all(),
            t.confirm_all(),
            t.metrics_all(),
            t.results(name),
            t.late(name),
            t.deadletter(name),
        ]

    def on_message(self, message: Message) -> None:
        """Take one message from any of ``filters()``; unknown or bad ones are ignored."""
        t, name = self.topics, self.spec.name
        topic = message.topic
        try:
            if topic == t.results(name):
                self._on_result(orjson.loads(message.payload))
            elif topic == t.late(name):
                late = orjson.loads(message.payload)
                self._late_members += late_memberships(late, self._first_window)
            elif topic == t.deadletter(name):
                self.deadletters += 1
            elif topic.startswith(t.gateway_status_all()[:-1]):
                if message.payload:
                    status = GatewayStatus.from_json(message.payload)
                    self.status[status.gateway_id] = status
                    self._status_seen_ms[status.gateway_id] = self.clock.now_ms()
                    rate = self._in.setdefault(status.gateway_id, _Rate())
                    rate.add(self.clock.monotonic(), status.rows_total)
            elif topic.startswith(t.confirm_all()[:-1]):
                if message.payload:
                    confirm = Confirm.from_json(message.payload)
                    if confirm.pipeline == name:
                        self.confirms.setdefault(confirm.gateway_id, {})[confirm.partition] = (
                            confirm.seq
                        )
            elif topic.startswith(t.metrics_all()[:-1]):
                self._on_metrics(orjson.loads(message.payload))
        except (ValueError, KeyError, TypeError, SchemaError):
            return  # a malformed message says nothing about the pipeline

    def _on_metrics(self, body: dict[str, Any]) -> None:
        component = body.get("component")
        if component == "worker":
            if body.get("state") == "gone":
                self.workers.pop(str(body.get("id")), None)
            elif body.get("pipeline") == self.spec.name or self.spec.name in (
                body.get("serving") or {}
            ):
                # A pool worker serving this pipeline (among others) counts as one of its own.
                self.workers[str(body["id"])] = (self.clock.now_ms(), body)
        elif component == "combiner" and body.get("pipeline") == self.spec.name:
            self.combiners[int(body["partition"])] = body
            if int(body["partition"]) == 0:
                self._out.add(self.clock.monotonic(), int(body.get("batch_rows", 0)))

    def _on_result(self, body: dict[str, Any]) -> None:
        if body.get("part", 0) == 0:  # a window split into parts counts once
            self.windows_emitted += 1
        if body.get("window") == self._first_window:
            self._result_members += int(body.get("rows", 0))
        for row in body.get("results", [])[: self.latest_keys]:
            key = str(row.get("key"))
            self.latest[key] = {"window": body["window"], "start": body["start"], **row}
            if len(self.latest) > self.latest_keys:
                self.latest.pop(next(iter(self.latest)))

    @property
    def rows_in_results(self) -> int:
        """Measurements counted in window results (of the first window spec)."""
        return self._result_members // self._per_row

    @property
    def late_rows(self) -> int:
        """Measurements reported late (of the first window spec)."""
        return self._late_members // self._per_row

    @property
    def rows_generated(self) -> int:
        """Measurements sealed by every gateway seen so far."""
        return sum(s.rows_total for s in self.status.values())

    def gateway_lag(self) -> list[GatewayLag]:
        """Lag per gateway (see the module docstring)."""
        now = self.clock.now_ms()
        out = []
        for gateway_id, status in sorted(self.status.items()):
            parts = self.confirms.get(gateway_id, {})
            confirmed = (
                min(parts.get(p, -1) for p in range(self.spec.partitions))
                if parts
                else status.first_unconfirmed_seq - 1
            )
            confirmed = max(confirmed, status.first_unconfirmed_seq - 1)
            last = status.next_seq - 1
            oldest = status.oldest_unconfirmed_ms
            # Age on the gateway's own clock when it spoke, plus the time since: no clock skew.
            seen = self._status_seen_ms.get(gateway_id, now)
            age = None if oldest is None else max(0, status.at_ms - oldest) + max(0, now - seen)
            out.append(
                GatewayLag(
                    gateway_id=gateway_id,
                    last_seq=last,
                    confirmed_seq=confirmed,
                    batches=max(0, last - confirmed),
                    rows=status.unconfirmed_rows,
                    oldest_age_ms=age,
                )
            )
        return out

    def snapshot(self) -> Snapshot:
        """The pipeline now."""
        now_ms = self.clock.now_ms()
        now_s = self.clock.monotonic()
        live = {
            wid: body
            for wid, (seen, body) in self.workers.items()
            if now_ms - seen <= HEARTBEAT_TIMEOUT_MS
        }
        lag = self.gateway_lag()
        ages = [g.oldest_age_ms for g in lag if g.oldest_age_ms is not None and g.batches > 0]
        applied = int(self.combiners.get(0, {}).get("batch_rows", 0))
        return Snapshot(
            at_ms=now_ms,
            rows_in_per_s=sum(r.per_second(now_s) for r in self._in.values()),
            rows_out_per_s=self._out.per_second(now_s),
            workers=tuple(sorted(live)),
            lag=tuple(lag),
            lag_batches=sum(g.batches for g in lag),
            lag_rows=sum(g.rows for g in lag),
            oldest_unconfirmed_age_ms=max(ages) if ages else None,
            rows_generated=self.rows_generated,
            batch_rows_applied=applied,
            windows_emitted=self.windows_emitted,
            rows_in_results=self.rows_in_results,
            deadletters=self.deadletters,
            late_rows=self.late_rows,
            window_memberships=self._result_members + self._late_members,
            windows_per_row=self._per_row,
            latest=tuple(reversed(list(self.latest.values()))),
            combiners=dict(self.combiners),
            worker_metrics=live,
        )
