"""The gateway simulator: g gateways fed by synthetic sensors in an open loop.

A scheduler ticks every ``tick_ms`` and hands every measurement whose event time has passed
(``SensorField.take(now)``) to its ``Gateway`` with ``add_block``: generation never waits
for publishing, so a slow broker or pipeline shows up as a lower achieved rate and a
growing spool instead of a slower offered rate.

Sensors measure on true time; the gateways stamp with their own clock. With a
``SkewedClock`` (offset, drift, jumps) the schedule follows its base and every measurement's
timestamp is moved by the clock's skew at the tick: a clock that jumps ahead leaves a gap in
event time, one that jumps back repeats an interval, and neither makes the sensors measure
faster or fall silent. ``late_share`` moves a share of the measurements further back
(``LateShare``).

A composition root: imported by the CLI (``shoal simulate``) and tests only.
"""

from __future__ import annotations

import logging
import resource
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

import psutil

from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SkewedClock, SystemClock
from shoal.errors import ConfigError
from shoal.gateway import Gateway, GatewayConfig, GatewayStats
from shoal.loadtest._sink import SinkConfig, SinkCounts, SinkProcess
from shoal.loadtest.data import LateShare, SensorField
from shoal.schemas import Encoding, Topics
from shoal.schemas.topics import check_segment

log = logging.getLogger(__name__)

SpoolMode = Literal["disk", "memory", "off"]
SinkMode = Literal["none", "count", "confirm"]

TOLERANCE: Final = 0.02
UNREACHABLE_S: Final = 3.0
"""Stopping, the waits for the broker (publishes, confirmations) end once no gateway has
been connected for this long: the spools keep what is unconfirmed."""
"""Achieved must be within this fraction of offered for a run to pass."""


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """What to simulate.

    Attributes:
        gateways: number of gateways.
        sensors: sensors per gateway.
        rate_hz: measurements per second per sensor.
        batch_size: rows per batch.
        encoding: batch encoding.
        zstd: compress binary-columnar bodies.
        duration_s: how long to generate.
        spool: ``disk`` (the real thing), ``memory``, or ``off`` (drop a batch once the
            broker accepted it: broker-only load tests, no end-to-end guarantee).
        spool_dir: where disk spools go (one folder per gateway); None: a temporary folder,
            removed afterwards.
        sink: ``count`` runs a plain subscriber in a child process that counts what arrives;
            ``confirm`` also confirms batches (so spools drain); ``none`` neither.
        seed: random seed of the sensors (gateway i uses ``seed + i``).
        attributes: measurements also carry name, type and unit (``loadtest.data.KINDS``).
        stream: the stream gateways publish to.
        gateway_prefix: gateway ids are ``<prefix>000``, ``<prefix>001``, ...
        topics: topic namespace.
        broker: where the broker is.
        tick_ms: scheduler period.
        max_delay_ms: seal a partial batch after this long.
        max_unconfirmed_bytes: the gateways' end-to-end window (None: ``GatewayConfig``'s).
        resend_after_ms: the gateways' stall timer for re-sends (None: ``GatewayConfig``'s).
        drain_timeout_s: after generation, how long to wait for publishing to finish.
        confirm_wait_s: after publishing, how long to wait for a pipeline to confirm every
            batch before exiting (0: do not wait, unless the sink confirms).
        late_share: fraction of measurements whose timestamps move back by ``late_by_ms``
            (``LateShare``; gateway i draws from ``seed + i``).
        late_by_ms: how far back; above the pipeline's lateness plus a window, they are late.
        stagger: seal the gateways out of step (``batch_span_s``, ``_Stagger``). Gateways
            started together otherwise seal in lock-step, every one at the same moment of
            each span, so what a pipeline has applied grows in steps of all the gateways'
            batches at once; staggered, in steps of one gateway's batch.
    """

    gateways: int = 1
    sensors: int = 1000
    rate_hz: float = 25.0
    batch_size: int = 16_000
    encoding: Encoding = Encoding.BINARY_COLUMNAR
    zstd: bool = False
    duration_s: float = 60.0
    spool: SpoolMode = "disk"
    spool_dir: Path | None = None
    sink: SinkMode = "none"
    seed: int = 0
    attributes: bool = False
    stream: str = "sim"
    gateway_prefix: str = "sim-gw"
    topics: Topics = field(default_factory=Topics)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    tick_ms: int = 50
    max_delay_ms: int = 1_000
    max_unconfirmed_bytes: int | None = None
    resend_after_ms: int | None = None
    drain_timeout_s: float = 30.0
    confirm_wait_s: float = 0.0
    late_share: float = 0.0
    late_by_ms: int = 60_000
    stagger: bool = False

    def __post_init__(self) -> None:
        """Refuse settings that cannot run."""
        if not 0.0 <= self.late_share <= 1.0 or self.late_by_ms <= 0:
            raise ConfigError("late_share must lie in [0, 1] and late_by_ms be positive")
        if self.gateways <= 0 or self.sensors <= 0 or self.rate_hz <= 0:
            raise ConfigError("gateways, sensors and rate must be positive")
        if self.duration_s <= 0 or self.tick_ms <= 0:
            raise ConfigError("duration and tick must be positive")
        if self.spool not in ("disk", "memory", "off"):
            raise ConfigError(f"spool must be disk, memory or off, not {self.spool!r}")
        if self.sink not in ("none", "count", "confirm"):
            raise ConfigError(f"sink must be none, count or confirm, not {self.sink!r}")
        check_segment(f"{self.gateway_prefix}000", "gateway prefix")  # TopicError: ConfigError
        check_segment(self.stream, "stream")

    @property
    def offered_rate(self) -> float:
        """Measurements per second offered, in all."""
        return self.gateways * self.sensors * self.rate_hz

    @property
    def batch_span_s(self) -> float:
        """Seconds of one gateway's measurements in a batch: it fills, or it is due by age."""
        return min(self.max_delay_ms / 1000.0, self.batch_size / (self.sensors * self.rate_hz))

    def gateway_ids(self) -> list[str]:
        """The simulated gateways' ids."""
        return [f"{self.gateway_prefix}{i:03d}" for i in range(self.gateways)]


@dataclass(frozen=True, slots=True)
class SimulationProgress:
    """One progress sample (about once a second)."""

    elapsed_s: float
    offered_rows: int
    rows_sealed: int
    rows_published: int
    batches_published: int
    bytes_published: int
    resends: int
    spool_batches: int
    spool_bytes: int
    cpu_percent: float
    sink_rows: int | None


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """The outcome of a run.

    Rates are measurements per second. ``achieved_rate`` counts rows the broker accepted
    (PUBACK) over the time from the start until the last of them was accepted, so a
    publisher that falls behind shows up even if it catches up after generation stops.
    ``within_tolerance``: achieved within ``TOLERANCE`` of offered either way; ``kept_up``:
    not below it (catching up after a broker restart may run above the offered rate).
    ``delivered`` is what the exit code stands on: the broker accepted every sealed row and,
    where the run waited for confirmations, the pipeline confirmed every batch.
    CPU is this process only (the broker and the sink run elsewhere); ``observed_cpu``
    holds other processes' CPU % over the same time, by name.
    """

    config: dict[str, Any]
    stopped_early: bool
    duration_s: float
    wall_s: float
    offered_rows: int
    offered_rate: float
    nominal_rate: float
    rows_sealed: int
    rows_published: int
    achieved_rate: float
    achieved_ratio: float
    within_tolerance: bool
    kept_up: bool
    delivered: bool
    batches_sealed: int
    batches_published: int
    bytes_published: int
    bytes_per_row: float
    publishes: int
    resends: int
    splits: int
    rejected: int
    spool_batches_max: int
    spool_bytes_max: int
    spool_batches_end: int
    all_published: bool
    confirmed: bool | None
    cpu_s: float
    cpu_percent: float
    rss_mb: float
    observed_cpu: dict[str, float]
    sink: dict[str, Any] | None
    rows_made_late: int = 0
    """Measurements whose timestamps ``late_share`` moved back (all gateways)."""

    def to_dict(self) -> dict[str, Any]:
        """As plain data (for ``--json``)."""
        return asdict(self)


@dataclass(slots=True)
class _Totals:
    rows_sealed: int = 0
    rows_published: int = 0
    batches_sealed: int = 0
    batches_published: int = 0
    bytes_published: int = 0
    publishes: int = 0
    resends: int = 0
    splits: int = 0
    rejected: int = 0
    spool_batches: int = 0
    spool_bytes: int = 0

    @classmethod
    def of(cls, stats: list[GatewayStats]) -> _Totals:
        total = cls()
        for s in stats:
            for name in cls.__slots__:
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


class Simulator:
    """Runs a simulation (see the module docstring).

    Args:
        config: what to simulate.
        clock: the gateways' clock (event times, sealing stamps); a ``SkewedClock`` runs
            the schedule on its base and shifts timestamps by its skew (module docstring).
        observe: other processes (name → pid) whose CPU to report, e.g. the broker.
    """

    def __init__(
        self,
        config: SimulationConfig,
        clock: Clock | None = None,
        *,
        observe: Mapping[str, int] | None = None,
    ) -> None:
        self.config = config
        self._clock: Clock = clock or SystemClock()
        # Sensors measure on true time (the schedule); the gateways stamp it with their skew.
        self._schedule: Clock = self._clock
        self._skew_at: Callable[[int], int] = lambda _ms: 0
        if isinstance(clock, SkewedClock):
            self._schedule, self._skew_at = clock.base, clock.skew_at
        self._observe = dict(observe or {})

    def _gateway_config(self, gateway_id: str, spool_root: Path | None) -> GatewayConfig:
        cfg = self.config
        config = GatewayConfig(
            gateway_id,
            stream=cfg.stream,
            broker=cfg.broker,
            topics=cfg.topics,
            encoding=cfg.encoding,
            zstd=cfg.zstd,
            batch_size=cfg.batch_size,
            max_delay_ms=cfg.max_delay_ms,
            spool_dir=spool_root / gateway_id if spool_root else None,
            release_on_puback=cfg.spool == "off",
        )
        if cfg.max_unconfirmed_bytes is not None:
            config = replace(config, max_unconfirmed_bytes=cfg.max_unconfirmed_bytes)
        if cfg.resend_after_ms is not None:
            config = replace(config, resend_after_ms=cfg.resend_after_ms)
        return config

    def run(
        self,
        stop: threading.Event | None = None,
        progress: Callable[[SimulationProgress], None] | None = None,
    ) -> SimulationReport:
        """Run until ``duration_s`` has passed or ``stop`` is set; report.

        Raises:
            BrokerError: the sink could not subscribe.
            SpoolError: a spool could not be opened.
        """
        cfg = self.config
        stop = stop or threading.Event()
        temp_root: Path | None = None
        spool_root = cfg.spool_dir
        if cfg.spool == "disk" and spool_root is None:
            temp_root = spool_root = Path(tempfile.mkdtemp(prefix="shoal-sim-spool-"))
        sink: SinkProcess | None = None
        gateways: list[Gateway] = []
        try:
            if cfg.sink != "none":
                sink = SinkProcess(
                    SinkConfig.from_settings(
                        cfg.broker, cfg.topics, cfg.stream, confirm=cfg.sink == "confirm"
                    )
                )
            for gateway_id in cfg.gateway_ids():
                root = spool_root if cfg.spool == "disk" else None
                gateways.append(Gateway(self._gateway_config(gateway_id, root), self._clock))
            for gateway in gateways:
                gateway.start()
            self._wait_connected(gateways, stop)
            return self._drive(gateways, sink, stop, progress)
        finally:
            for gateway in gateways:
                gateway.close(timeout_s=0)
            if sink is not None:
                sink.close()
            if temp_root is not None:
                shutil.rmtree(temp_root, ignore_errors=True)

    @staticmethod
    def _wait_connected(gateways: list[Gateway], stop: threading.Event) -> None:
        deadline = time.monotonic() + 10.0
        while not stop.is_set() and time.monotonic() < deadline:
            if all(g.stats().connected for g in gateways):
                return
            time.sleep(0.02)
        log.warning("not every gateway connected within 10 s; starting anyway")

    def _drive(
        self,
        gateways: list[Gateway],
        sink: SinkProcess | None,
        stop: threading.Event,
        progress: Callable[[SimulationProgress], None] | None,
    ) -> SimulationReport:
        cfg = self.config
        start_ms = self._schedule.now_ms()
        end_ms = start_ms + int(cfg.duration_s * 1000)
        fields = [
            SensorField(
                g.config.gateway_id,
                cfg.sensors,
                cfg.rate_hz,
                start_ms,
                seed=cfg.seed + i,
                attributes=cfg.attributes,
            )
            for i, g in enumerate(gateways)
        ]
        late = [LateShare(cfg.late_share, cfg.late_by_ms, cfg.seed + i) for i in range(len(fields))]
        observed = {name: psutil.Process(pid) for name, pid in self._observe.items()}
        if sink is not None:
            observed["sink"] = psutil.Process(sink.pid)
        observed_cpu0 = {name: _proc_cpu(p) for name, p in observed.items()}
        t0, cpu0 = time.monotonic(), _cpu_s()
        offered, now_ms, peak = self._generate(
            gateways,
            fields,
            late,
            end_ms=end_ms,
            stop=stop,
            sampler=_Sampler(t0, cpu0),
            sink=sink,
            progress=progress,
        )
        stopped_early = now_ms < end_ms
        duration_s = (now_ms - start_ms) / 1000.0
        for gateway in gateways:
            gateway.flush()
        reach = _Reach(gateways, stop)
        all_published, last_ack = self._wait_published(gateways, reach)
        totals = _Totals.of([g.stats() for g in gateways])
        peak = max(peak, (totals.spool_batches, totals.spool_bytes))
        confirmed: bool | None = None
        if cfg.confirm_wait_s > 0:
            confirmed = reach.wait_confirmed(cfg.confirm_wait_s)
        elif cfg.spool == "off" or cfg.sink == "confirm":
            remaining = max(1.0, cfg.drain_timeout_s - (time.monotonic() - last_ack))
            confirmed = reach.wait_confirmed(remaining)
        sink_counts: SinkCounts | None = None
        if sink is not None and not reach.gave_up:
            sink.wait_rows(totals.rows_published, timeout_s=10.0)
        wall_s = time.monotonic() - t0
        cpu_s = _cpu_s() - cpu0
        observed_cpu = {
            name: round(100.0 * (_proc_cpu(p) - observed_cpu0[name]) / wall_s, 1)
            for name, p in observed.items()
        }
        if sink is not None:
            sink_counts = sink.stop()
        end = _Totals.of([g.stats() for g in gateways])
        return self._report(
            offered=offered,
            duration_s=duration_s,
            publish_s=last_ack - t0,
            wall_s=wall_s,
            cpu_s=cpu_s,
            totals=end,
            peak=peak,
            stopped_early=stopped_early,
            all_published=all_published,
            confirmed=confirmed,
            observed_cpu=observed_cpu,
            sink=sink_counts,
            rows_made_late=sum(share.made_late for share in late),
        )

    def _generate(
        self,
        gateways: list[Gateway],
        fields: list[SensorField],
        late: list[LateShare],
        *,
        end_ms: int,
        stop: threading.Event,
        sampler: _Sampler,
        sink: SinkProcess | None,
        progress: Callable[[SimulationProgress], None] | None,
    ) -> tuple[int, int, tuple[int, int]]:
        """The open loop; returns (rows offered, event time reached, peak spool)."""
        tick_s = self.config.tick_ms / 1000.0
        next_tick = time.monotonic()
        next_report = next_tick + 1.0
        stagger = _Stagger(gateways if self.config.stagger else [], self.config.batch_span_s)
        offered = 0
        peak = (0, 0)
        while True:
            now_ms = min(self._schedule.now_ms(), end_ms)
            skew = self._skew_at(now_ms)
            for gateway, sensor_field, share in zip(gateways, fields, late, strict=True):
                block = sensor_field.take(now_ms)
                if len(block):
                    if skew:
                        block = replace(block, ts=block.ts + skew)
                    gateway.add_block(share.apply(block))
                    offered += len(block)
            if offered:
                stagger.seal_due(time.monotonic())
            if now_ms >= end_ms or stop.is_set():
                return offered, now_ms, peak
            if time.monotonic() >= next_report:
                next_report += 1.0
                totals = _Totals.of([g.stats() for g in gateways])
                peak = max(peak, (totals.spool_batches, totals.spool_bytes))
                if progress is not None:
                    progress(sampler.sample(offered, totals, sink))
            next_tick += tick_s
            # Sleep to the next tick; if we are late, run at once (never skip event time).
            stop.wait(max(0.0, next_tick - time.monotonic()))

    def _wait_published(self, gateways: list[Gateway], reach: _Reach) -> tuple[bool, float]:
        """Wait until the broker accepted every sealed row; returns (all, when the last was).

        At most ``drain_timeout_s``: a backlog that the gateways' flow-control window holds in
        the spools drains at the pipeline's pace, and a stopped simulator should not wait for
        that unless told to (``confirm_wait_s``, during which the gateways go on publishing).
        """
        deadline = time.monotonic() + self.config.drain_timeout_s
        last = time.monotonic()
        published = -1
        while True:
            totals = _Totals.of([g.stats() for g in gateways])
            if totals.rows_published != published:
                published, last = totals.rows_published, time.monotonic()
            if totals.rows_published >= totals.rows_sealed:
                return True, last
            if time.monotonic() >= deadline or reach.lost():
                return False, last
            time.sleep(0.005)

    def _report(
        self,
        *,
        offered: int,
        duration_s: float,
        publish_s: float,
        wall_s: float,
        cpu_s: float,
        totals: _Totals,
        peak: tuple[int, int],
        stopped_early: bool,
        all_published: bool,
        confirmed: bool | None,
        observed_cpu: dict[str, float],
        sink: SinkCounts | None,
        rows_made_late: int,
    ) -> SimulationReport:
        cfg = self.config
        offered_rate = offered / duration_s if duration_s > 0 else 0.0
        achieved = totals.rows_published / publish_s if publish_s > 0 else 0.0
        ratio = achieved / offered_rate if offered_rate else 0.0
        config = asdict(replace(cfg))
        config["broker"] = cfg.broker.url
        config["topics"] = cfg.topics.root
        config["encoding"] = cfg.encoding.value
        config["spool_dir"] = str(cfg.spool_dir) if cfg.spool_dir else None
        return SimulationReport(
            config=config,
            stopped_early=stopped_early,
            duration_s=round(duration_s, 3),
            wall_s=round(wall_s, 3),
            offered_rows=offered,
            offered_rate=round(offered_rate, 1),
            nominal_rate=cfg.offered_rate,
            rows_sealed=totals.rows_sealed,
            rows_published=totals.rows_published,
            achieved_rate=round(achieved, 1),
            achieved_ratio=round(ratio, 4),
            within_tolerance=abs(ratio - 1.0) <= TOLERANCE and all_published,
            kept_up=ratio >= 1.0 - TOLERANCE,
            delivered=all_published and confirmed is not False,
            batches_sealed=totals.batches_sealed,
            batches_published=totals.batches_published,
            bytes_published=totals.bytes_published,
            bytes_per_row=round(totals.bytes_published / max(1, totals.rows_published), 2),
            publishes=totals.publishes,
            resends=totals.resends,
            splits=totals.splits,
            rejected=totals.rejected,
            spool_batches_max=peak[0],
            spool_bytes_max=peak[1],
            spool_batches_end=totals.spool_batches,
            all_published=all_published,
            confirmed=confirmed,
            cpu_s=round(cpu_s, 3),
            cpu_percent=round(100.0 * cpu_s / wall_s, 1) if wall_s > 0 else 0.0,
            rss_mb=round(psutil.Process().memory_info().rss / 2**20, 1),
            observed_cpu=observed_cpu,
            sink=asdict(sink) if sink is not None else None,
            rows_made_late=rows_made_late,
        )


class _Stagger:
    """Puts N gateways' sealing out of step, once, at the start (``SimulationConfig.stagger``).

    Gateway i (i > 0) seals what it holds early, ``i / N`` of a batch span after the first
    rows: its batches then fill (or age) from that moment on, so the N gateways seal spread
    evenly over every span. Costs each of them one early, smaller batch.
    """

    def __init__(self, gateways: list[Gateway], span_s: float) -> None:
        self._gateways = gateways
        self._span_s = span_s
        self._due: deque[tuple[float, Gateway]] | None = None

    def seal_due(self, now_s: float) -> None:
        """Seal early the gateways whose moment has come (the first call: the first rows)."""
        if self._due is None:
            step = self._span_s / max(1, len(self._gateways))
            self._due = deque((now_s + i * step, g) for i, g in enumerate(self._gateways) if i)
        while self._due and self._due[0][0] <= now_s:
            self._due.popleft()[1].flush()


def _proc_cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


class _Sampler:
    """Turns cumulative counters into per-interval progress samples."""

    def __init__(self, t0: float, cpu0: float) -> None:
        self._t0 = t0
        self._last = (t0, cpu0)

    def sample(self, offered: int, totals: _Totals, sink: SinkProcess | None) -> SimulationProgress:
        now, cpu = time.monotonic(), _cpu_s()
        last_t, last_cpu = self._last
        self._last = (now, cpu)
        interval = max(now - last_t, 1e-9)
        return SimulationProgress(
            elapsed_s=now - self._t0,
            offered_rows=offered,
            rows_sealed=totals.rows_sealed,
            rows_published=totals.rows_published,
            batches_published=totals.batches_published,
            bytes_published=totals.bytes_published,
            resends=totals.resends,
            spool_batches=totals.spool_batches,
            spool_bytes=totals.spool_bytes,
            cpu_percent=100.0 * (cpu - last_cpu) / interval,
            sink_rows=sink.counts.rows if sink is not None else None,
        )


class _Reach:
    """While stopping: whether to wait any longer for a broker that went away.

    A run stopped (``stop`` set) whose gateways have all been disconnected for
    ``UNREACHABLE_S`` gives up its waits, once, with a WARNING: a stop must not hang on a
    dead broker, and what is unconfirmed stays in the spools.
    """

    def __init__(self, gateways: list[Gateway], stop: threading.Event) -> None:
        self.gateways = gateways
        self.stop = stop
        self.gave_up = False
        self._offline_since: float | None = None

    def lost(self) -> bool:
        """Whether to stop waiting for the broker (see the class docstring)."""
        if self.gave_up:
            return True
        if not self.stop.is_set() or any(g.stats().connected for g in self.gateways):
            self._offline_since = None
            return False
        now = time.monotonic()
        if self._offline_since is None:
            self._offline_since = now
        if now - self._offline_since < UNREACHABLE_S:
            return False
        self.gave_up = True
        totals = _Totals.of([g.stats() for g in self.gateways])
        spooled = any(g.config.spool_dir for g in self.gateways)
        log.warning(
            "stopping with the broker unreachable for %.0f s: %d unconfirmed batch(es) %s",
            UNREACHABLE_S,
            totals.spool_batches,
            "stay in the spools" if spooled else "are dropped (no spool folder)",
        )
        return True

    def wait_confirmed(self, timeout_s: float) -> bool:
        """Whether every gateway's batches were confirmed within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not all(g.wait_confirmed(0) for g in self.gateways):
            if time.monotonic() >= deadline or self.lost():
                return False
            time.sleep(0.02)
        return True
