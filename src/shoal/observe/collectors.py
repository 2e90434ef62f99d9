"""Prometheus collectors over the counters each long-running process already keeps.

One collector per kind of process; each reads, at scrape time, the same objects the process's
MQTT heartbeat (or ``--json`` report) reads, so there is one source of truth and nothing is
added to a hot path. Names follow Prometheus conventions: ``shoal_<component>_<what>``,
``_total`` for counters, units in names (``_seconds``, ``_bytes``). Labels are bounded:
pipeline, partition, reason, sink, mapping, outcome — never a key, and a gateway only where a
process is one gateway (the adapter). The list with meanings: docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from shoal.errors import BrokerError
from shoal.observe._exposition import Families

if TYPE_CHECKING:
    from shoal.adapters import Adapter
    from shoal.archive import Archiver
    from shoal.control.service import ControlPlane
    from shoal.runtime.combiner import CombinerRuntime
    from shoal.runtime.hosting import CombinerHost
    from shoal.runtime.scaler import Scaler
    from shoal.runtime.worker import Worker
    from shoal.sinks.follow import Follower

__all__ = [
    "AdapterCollector",
    "ArchiveCollector",
    "CombinerCollector",
    "CombinerPoolCollector",
    "ControlCollector",
    "ScalerCollector",
    "SinkCollector",
    "WorkerCollector",
]


class WorkerCollector(Collector):
    """``shoal worker`` (pinned or pool): ``Worker.counters`` and ``Worker.stats``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        """The worker's families, now."""
        w = self.worker
        c = w.counters
        f = Families()
        none: dict[str, str] = {}
        f.counter("shoal_worker_batches_total", "Batches decoded into partials.", none, c.batches)
        f.counter("shoal_worker_measurements_total", "Measurements in those batches.", none, c.rows)
        f.counter(
            "shoal_worker_measurements_filtered_total",
            "Measurements the row stage removed (where false, derived value not finite).",
            none,
            c.rows_filtered,
        )
        f.counter(
            "shoal_worker_measurements_clamped_total",
            "Measurements stamped beyond max_future_ms and clamped.",
            none,
            c.rows_clamped,
        )
        f.counter("shoal_worker_partials_total", "Partials published.", none, c.partials)
        letters: dict[str, dict[str, float]] = {}
        for (pipeline, reason), n in w.stats.deadletter_reasons.items():
            letters.setdefault(pipeline, {})[reason] = n
        doc = "Input messages dead-lettered, by pipeline and reason."
        f.counter("shoal_worker_deadletters_total", doc, {"pipeline": "", "reason": ""}, None)
        for pipeline, reasons in sorted(letters.items()):
            f.counter_by(
                "shoal_worker_deadletters_total", doc, {"pipeline": pipeline}, "reason", reasons
            )
        f.counter(
            "shoal_worker_busy_seconds_total", "Seconds spent handling batches.", none, c.busy_s
        )
        f.counter(
            "shoal_worker_reconnects_total", "Reconnections to the broker.", none, c.reconnects
        )
        f.counter(
            "shoal_worker_unrouted_total",
            "Deliveries no served pipeline claimed (should stay 0).",
            none,
            c.unrouted,
        )
        described = w.routes.describe()
        serving = described.get("serving")
        f.gauge(
            "shoal_worker_pipelines",
            "Pipelines this worker serves (1 when pinned; the deployed ones in the pool).",
            none,
            len(serving) if isinstance(serving, Mapping) else 1,
        )
        f.histogram(
            "shoal_worker_batch_handle_seconds",
            "Wall time to decode a batch and compute its partials.",
            none,
            w.stats.handle_latency,
        )
        yield from f


def _combiner_families(f: Families, runtime: CombinerRuntime) -> None:
    """One partition's families (a pinned combiner, or a partition hosted by the pool)."""
    spec = runtime.config.spec
    at = {"pipeline": spec.name, "partition": str(runtime.config.partition)}
    core = runtime.core
    c = core.counters
    counters: tuple[tuple[str, str, float], ...] = (
        ("partials", "Partials received.", c.partials_received),
        ("batches_applied", "Batches applied (each once).", c.batches_applied),
        ("batches_rejected", "Batches applied as refused by a worker.", c.batches_rejected),
        ("duplicate_batches", "Batches dropped as already applied.", c.duplicate_batches),
        ("deferred_batches", "Early batches let go (reorder buffer full).", c.deferred_batches),
        ("partials_refused", "Partials refused (unreadable, foreign).", runtime.partials_refused),
        ("measurements", "Measurements of applied batches.", c.batch_rows),
        (
            "window_measurements",
            "Measurements counted into windows (once per window they fall in).",
            c.rows_applied,
        ),
        ("late_measurements", "Measurements too late to count.", c.rows_late),
        (
            "corrected_measurements",
            "Measurements that reached a closed window in time to revise it.",
            c.rows_corrected,
        ),
        ("corrections", "Revised window results published.", c.corrections_emitted),
        ("windows_closed", "Windows closed.", c.windows_closed),
        ("result_rows", "Result rows (window, key) published.", c.results_emitted),
        ("windows_dropped", "Closed windows no longer kept for corrections.", c.windows_dropped),
        ("result_rows_withheld", "Result rows kept back by `having`.", c.results_withheld),
        ("measurements_filtered", "Measurements the workers' row stage removed.", c.rows_filtered),
        ("checkpoints", "Checkpoints written.", runtime.checkpoints),
        ("gaps_reported", "Missing seqs named in confirmations.", runtime.gaps_reported),
        (
            "key_results_superseded",
            "Per-key results not published: a newer result of the key was queued.",
            runtime.key_publications.superseded,
        ),
    )
    for name, doc, value in counters:
        f.counter(f"shoal_combiner_{name}_total", doc, at, value)
    f.counter(
        "shoal_combiner_deadletters_total",
        "Results dead-lettered, by reason.",
        {**at, "reason": "result_too_large"},
        runtime.results_refused,
    )
    now_ms = runtime.clock.now_ms()
    watermark = core.watermark()
    f.gauge(
        "shoal_combiner_watermark_seconds",
        "The watermark the gateways hold the pipeline at (event time, Unix seconds).",
        at,
        None if watermark is None else watermark / 1000.0,
    )
    f.gauge(
        "shoal_combiner_watermark_delay_seconds",
        "Now minus the watermark: how far event time lags behind the clock.",
        at,
        None if watermark is None else (now_ms - watermark) / 1000.0,
    )
    f.gauge(
        "shoal_combiner_closed_through_seconds",
        "Windows ending at or before this event time are closed (Unix seconds).",
        at,
        None if core.closed_through is None else core.closed_through / 1000.0,
    )
    tracker = core.tracker
    gateways = tracker.gateways.values()
    f.gauge("shoal_combiner_gateways", "Gateways this partition has seen.", at, len(gateways))
    f.gauge(
        "shoal_combiner_gateways_holding",
        "Gateways holding the watermark back now.",
        at,
        sum(1 for g in gateways if tracker.holds(g, now_ms)),
    )
    f.gauge(
        "shoal_combiner_gateways_released",
        "Gateways released from holding after max_hold_ms.",
        at,
        sum(1 for g in gateways if g.released),
    )
    f.gauge(
        "shoal_combiner_lag_batches",
        "Batches gateways announced that this partition has not applied yet.",
        at,
        sum(
            max(0, g.announced_next_seq - g.next_seq)
            for g in gateways
            if g.announced_next_seq is not None and g.next_seq is not None
        ),
    )
    f.gauge(
        "shoal_combiner_pending_batches",
        "Early batches waiting for earlier seqs.",
        at,
        sum(len(g.pending) for g in gateways),
    )
    f.gauge(
        "shoal_combiner_pending_bytes", "Bytes of those held in memory.", at, tracker.pending_weight
    )
    f.gauge(
        "shoal_combiner_spilled_batches",
        "Early batches kept in files (memory for them full).",
        at,
        tracker.spilled,
    )
    f.gauge(
        "shoal_combiner_state_rows",
        "Open window state cells, what max_state_cells caps (all window kinds).",
        at,
        core.state_cells,
    )
    f.gauge(
        "shoal_combiner_max_state_cells",
        "The state cap in force: [limits] max_state_cells, or sized from memory.",
        at,
        core.state_cap,
    )
    f.gauge(
        "shoal_combiner_kept_windows",
        "Closed windows kept for corrections.",
        at,
        core.kept_windows(),
    )
    f.histogram(
        "shoal_combiner_apply_latency_seconds",
        "From a batch's seal at the gateway to its partial applied here.",
        at,
        runtime.apply_latency,
    )
    f.histogram(
        "shoal_combiner_result_latency_seconds",
        "From a window's close to its result acknowledged by the broker.",
        at,
        runtime.result_latency,
    )


class CombinerCollector(Collector):
    """``shoal combiner --pipeline``: one partition."""

    def __init__(self, runtime: CombinerRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        """The partition's families, now."""
        f = Families()
        _combiner_families(f, self.runtime)
        yield from f


class CombinerPoolCollector(Collector):
    """``shoal combiner`` (pool): every hosted partition, and the membership."""

    def __init__(self, host: CombinerHost) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        """The hosted partitions' families and the pool's, now."""
        host = self.host
        f = Families()
        owned: Counter[str] = Counter(dict.fromkeys(host.deployed, 0))
        for (pipeline, _), term in sorted(host.terms.items()):
            owned[pipeline] += 1
            _combiner_families(f, term.runtime)
        for pipeline, n in sorted(owned.items()):
            f.gauge(
                "shoal_combiner_pool_owned_partitions",
                "Partitions this member runs now, by pipeline.",
                {"pipeline": pipeline},
                n,
            )
        none: dict[str, str] = {}
        f.gauge(
            "shoal_combiner_pool_pipelines_deployed",
            "Pipelines deployed (as this member follows them).",
            none,
            len(host.deployed),
        )
        f.gauge("shoal_combiner_pool_members", "Live pool members seen.", none, len(host.members))
        c = host.counters
        f.counter(
            "shoal_combiner_pool_terms_started_total", "Terms started.", none, c.terms_started
        )
        f.counter(
            "shoal_combiner_pool_terms_deposed_total",
            "Terms ended by another owner or a lost connection.",
            none,
            c.terms_deposed,
        )
        f.counter(
            "shoal_combiner_pool_terms_failed_total",
            "Terms ended by an error.",
            none,
            c.terms_failed,
        )
        yield from f


class AdapterCollector(Collector):
    """``shoal adapt``: ``Adapter.stats`` and its gateway's counters."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def collect(self) -> Iterator[Metric]:
        """The adapter's families, now."""
        a = self.adapter
        s = a.stats
        at = {"mapping": a.config.mapping.name}
        f = Families()
        f.counter("shoal_adapter_messages_total", "Device messages received.", at, s.messages)
        f.counter(
            "shoal_adapter_measurements_total", "Measurements sealed into the spool.", at, s.rows
        )
        f.counter("shoal_adapter_seals_total", "Seals into the gateway spool.", at, s.seals)
        f.counter_by(
            "shoal_adapter_deadletters_total",
            "Device messages dead-lettered, by reason.",
            at,
            "reason",
            s.refused,
        )
        f.counter(
            "shoal_adapter_redeliveries_total",
            "Broker re-sends already in the intake log (dropped).",
            at,
            s.redeliveries,
        )
        f.counter(
            "shoal_adapter_duplicates_total",
            "Device re-sends dropped by message id.",
            at,
            s.duplicates,
        )
        f.counter("shoal_adapter_commands_total", "Messages sent to devices.", at, s.commands)
        try:
            gateway = a.gateway
        except BrokerError:
            gateway = None  # before run() opened it
        if gateway is not None:
            g = gateway.stats()
            gw = {"gateway": a.config.adapter_id}
            f.counter(
                "shoal_gateway_batches_published_total",
                "Distinct batches the broker accepted.",
                gw,
                g.batches_published,
            )
            f.counter(
                "shoal_gateway_batches_confirmed_total",
                "Batches the combiners confirmed.",
                gw,
                g.batches_confirmed,
            )
            f.counter(
                "shoal_gateway_measurements_published_total",
                "Measurements in published batches.",
                gw,
                g.rows_published,
            )
            f.counter("shoal_gateway_resends_total", "Batches published again.", gw, g.resends)
            f.gauge(
                "shoal_gateway_unconfirmed_batches",
                "Batches sealed but not confirmed yet (the gateway's lag).",
                gw,
                g.spool_batches,
            )
            f.gauge("shoal_gateway_spool_bytes", "Bytes in the spool.", gw, g.spool_bytes)
            f.gauge("shoal_gateway_connected", "1 while connected.", gw, int(g.connected))
        yield from f


class ArchiveCollector(Collector):
    """``shoal archive``: ``Archiver.report()``."""

    def __init__(self, archiver: Archiver) -> None:
        self.archiver = archiver

    def collect(self) -> Iterator[Metric]:
        """The archiver's families, now."""
        r = self.archiver.report()
        none: dict[str, str] = {}
        f = Families()
        f.counter(
            "shoal_archive_batches_total", "Input batches received.", none, r.received_batches
        )
        f.counter(
            "shoal_archive_result_messages_total",
            "Window result messages received.",
            none,
            r.received_results,
        )
        f.counter(
            "shoal_archive_duplicate_results_total",
            "Result copies dropped as already archived.",
            none,
            r.duplicate_results,
        )
        f.counter(
            "shoal_archive_unreadable_results_total",
            "Result messages that could not be read (skipped).",
            none,
            r.unreadable_results,
        )
        for kind, n in sorted(r.files_by_kind.items()):
            f.counter("shoal_archive_files_total", "Part files written.", {"kind": kind}, n)
        f.counter("shoal_archive_rows_written_total", "Rows written.", none, r.rows_written)
        f.counter("shoal_archive_written_bytes_total", "File bytes written.", none, r.file_bytes)
        f.counter(
            "shoal_archive_write_seconds_total", "Seconds spent writing.", none, r.write_seconds
        )
        f.counter(
            "shoal_archive_backpressure_waits_total",
            "Pauses for the memory budget.",
            none,
            r.backpressure_waits,
        )
        f.counter("shoal_archive_reconnects_total", "Broker reconnections.", none, r.reconnects)
        f.gauge(
            "shoal_archive_peak_buffered_bytes",
            "Most bytes buffered at once.",
            none,
            r.peak_buffered_bytes,
        )
        yield from f


class SinkCollector(Collector):
    """``shoal sink postgres|webhook``: the follower's counters and the sink's report.

    ``report`` is what ``--json`` writes (``PostgresStats.to_dict``, ``WebhookStats.to_dict``):
    its counters become ``shoal_sink_*`` families, so the two sinks share one vocabulary.
    """

    def __init__(
        self,
        kind: str,
        pipeline: str,
        follower: Follower,
        report: Callable[[], Mapping[str, object]],
    ) -> None:
        self.kind = kind
        self.pipeline = pipeline
        self.follower = follower
        self.report = report

    def collect(self) -> Iterator[Metric]:
        """The sink's families, now."""
        at = {"sink": self.kind, "pipeline": self.pipeline}
        fs = self.follower.stats
        report = self.report()
        f = Families()
        f.counter(
            "shoal_sink_acknowledged_total",
            "Messages acknowledged to the broker (after the sink's work was safe).",
            at,
            fs.acknowledged,
        )
        f.counter(
            "shoal_sink_broker_reconnects_total", "Broker reconnections.", at, fs.broker_reconnects
        )
        for field, (name, doc) in _SINK_COUNTERS.items():
            value = report.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                f.counter(f"shoal_sink_{name}_total", doc, at, value)
        for outcome in ("changed", "unchanged"):
            value = report.get(f"rows_{outcome}")
            if isinstance(value, int):
                f.counter(
                    "shoal_sink_rows_total",
                    "Result rows upserted, by outcome (unchanged: that copy was there already).",
                    {**at, "outcome": outcome},
                    value,
                )
        refused = report.get("refused")
        if isinstance(refused, Mapping):
            f.counter_by(
                "shoal_sink_refused_total",
                "Deliveries refused for good, by HTTP status.",
                at,
                "status",
                {str(status): n for status, n in refused.items()},
            )
        yield from f


_SINK_COUNTERS: Mapping[str, tuple[str, str]] = {
    "messages": ("messages", "Messages handled."),
    "unreadable": ("unreadable_messages", "Messages that could not be read (skipped, acked)."),
    "other_pipeline": ("other_pipeline_messages", "Messages of another pipeline (skipped)."),
    "db_retries": ("db_retries", "Database errors retried."),
    "db_connects": ("db_connects", "Database connections opened."),
    "commit_seconds": ("db_commit_seconds", "Seconds spent in database transactions."),
    "delivered": ("deliveries", "Deliveries the endpoint accepted."),
    "attempts": ("delivery_attempts", "HTTP requests made."),
    "retries": ("delivery_retries", "HTTP requests repeated after a failure."),
}
"""Report field → (family name without ``shoal_sink_`` and ``_total``, meaning)."""


class ControlCollector(Collector):
    """``shoal control``: ``ControlPlane.counters`` and the registry."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def collect(self) -> Iterator[Metric]:
        """The control plane's families, now."""
        c = self.plane.counters
        none: dict[str, str] = {}
        f = Families()
        f.gauge(
            "shoal_control_pipelines_deployed",
            "Pipelines deployed now.",
            none,
            len(self.plane.registry.deployed()),
        )
        for outcome, n in (("accepted", c.accepted), ("refused", c.refused)):
            f.counter(
                "shoal_control_requests_total",
                "Requests answered, by outcome.",
                {"outcome": outcome},
                n,
            )
        f.counter(
            "shoal_control_unanswerable_total",
            "Messages on request topics without a client to answer.",
            none,
            c.unanswerable,
        )
        f.counter(
            "shoal_control_restored_documents_total",
            "Pipeline documents read back at start.",
            none,
            c.restored,
        )
        f.counter(
            "shoal_control_invalid_documents_total",
            "Retained documents that could not be restored.",
            none,
            c.invalid_documents,
        )
        yield from f


class ScalerCollector(Collector):
    """``shoal scaler``: the samples of ``Scaler.metric_samples`` (its own ``/metrics``)."""

    def __init__(self, scaler: Scaler) -> None:
        self.scaler = scaler

    def collect(self) -> Iterator[Metric]:
        """The scaler's families, now."""
        f = Families()
        for name, kind, doc, labels, value in self.scaler.metric_samples():
            if kind == "counter":
                f.counter(name, doc, labels, value)
            else:
                f.gauge(name, doc, labels, value)
        yield from f
