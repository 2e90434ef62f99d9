"""``shoal up``: the embedded broker, a pipeline, simulated gateways and a live view, in one go.

Everything runs as child processes of this one (``LocalPipeline``); this process only watches
and draws. On exit it settles the run (the simulator seals and sends its last batches, every
batch is confirmed, the combiners close every open window) and prints a summary that accounts
for every measurement: generated = applied (on time or late), or the difference is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

from shoal._stopping import stop_signals
from shoal.clock import Clock
from shoal.control.canonical import inline_files
from shoal.errors import ConfigError
from shoal.processors.spec import PipelineSpec
from shoal.runtime.loadtrace import GatewayLoad, Trace, TraceDriver
from shoal.runtime.local import (
    SIMULATOR_CONFIRM_WAIT_S,
    Accounting,
    LocalPipeline,
    LocalPipelineConfig,
)
from shoal.runtime.scaler import Scaler, ScalerConfig, ScaleRecord
from shoal.scaler.http import MetricsServer
from shoal.scaler.monitor import Snapshot
from shoal.scaler.policy import Bounds
from shoal.view.server import PageConfig, ViewServer
from shoal.view.status import gateway_notes, partition_notes, pipeline_status

LOAD_START_WAIT_S: Final = 30.0
"""``--duration`` counts from the first measurements, or from this long after the load started."""


@dataclass(frozen=True, slots=True)
class UpConfig:
    """What ``shoal up`` starts.

    Attributes:
        spec: the pipeline.
        spec_source: how children find the spec (a file path or a name in processors/).
        workers: worker processes to start with.
        profile: broker profile.
        scenario: simulator scenario (``A`` or ``B``), None for no simulated gateways.
        rate: measurements per second per sensor.
        batch: rows per batch.
        encoding: batch encoding.
        duration_s: stop after this long of load, counted from the first measurements (None:
            until Ctrl-C).
        run_dir: logs and state (None: a temporary folder).
        refresh_s: view refresh period.
        scale: scaling policy (``lag``, ``cpu``, ``rps``), None for a fixed worker count.
        bounds: worker limits of the scaler.
        trace: a load trace the simulated gateways follow (None: the scenario throughout).
        metrics_port: serve the scaler's Prometheus and KEDA endpoints here (None: no).
        control_plane: run the control plane too, for ``shoal pipeline`` (CONTRACT.md §22).
        view_port: serve the ``shoal view`` page here (0: any free port; None: no page).
        pool: pool workers and combiners, the pipeline deployed through the control plane
            (as ``shoal pipeline deploy``), so more pipelines can be deployed on them while
            this runs; False: components pinned to this pipeline.
    """

    spec: PipelineSpec
    spec_source: str
    workers: int = 2
    profile: str = "dev"
    scenario: str | None = "A"
    rate: float = 25.0
    batch: int = 4_000
    encoding: str = "binary"
    duration_s: float | None = None
    run_dir: Path | None = None
    refresh_s: float = 1.0
    scale: str | None = None
    bounds: Bounds = field(default_factory=lambda: Bounds(1, 4))
    trace: Trace | None = None
    metrics_port: int | None = None
    control_plane: bool = True
    view_port: int | None = None
    pool: bool = False


class Up:
    """Runs the whole thing (see the module docstring)."""

    def __init__(
        self, config: UpConfig, out: TextIO = sys.stdout, clock: Clock | None = None
    ) -> None:
        self.config = config
        self.out = out
        self.local = LocalPipeline(
            LocalPipelineConfig(
                spec=config.spec,
                spec_source=config.spec_source,
                workers=config.workers,
                profile=config.profile,
                run_dir=config.run_dir,
                control_plane=config.control_plane or config.pool,
                pool=config.pool,
            ),
            clock,
        )
        self._stop = asyncio.Event()
        self._tty = out.isatty()
        self._shown: set[tuple[str, int]] = set()  # windows in the last view (printed already)
        self._notes: dict[str, str] = {}  # gateways' event-time notes last printed
        self.scaler: Scaler | None = None
        self.scale_log: list[str] = []
        self._driver: TraceDriver | None = None

    def run(self) -> Accounting:
        """Start everything, show the view until the duration ends or Ctrl-C, then settle."""
        view = None
        try:
            self.local.start()
            view = self._start_view()
            return asyncio.run(self._main())
        finally:
            if view is not None:
                view.close()
            self.local.stop()

    async def _main(self) -> Accounting:
        loop = asyncio.get_running_loop()
        # Settling is bounded on its own (SETTLE_LIMIT_S); a second signal exits at once,
        # and the children (spawn_tied) get SIGTERM when we are gone.
        with stop_signals("shoal up", lambda: loop.call_soon_threadsafe(self._stop.set), None):
            return await self._run()

    async def _run(self) -> Accounting:
        started = self.local.clock.monotonic()
        url = self.local.broker.settings.url
        if self.config.control_plane or self.config.pool:
            self._line(f"control plane running: shoal pipeline list --broker {url}")
        if self.config.pool:
            message = await self.local.deploy(self._spec_toml())
            self._line(f"deployed through the control plane: {message}")
            self._line(f"pool workers serve more: shoal pipeline deploy FILE --broker {url}")
        async with self.local.watching() as session:
            await asyncio.sleep(1.5)  # let workers and combiners subscribe before data flows
            server = await self._start_scaler()
            try:
                self._start_load()
                await self._show(started)
            finally:
                if server is not None:
                    await server.close()
            self._line("stopping: sealing the last batches and waiting for confirmations ...")
            accounting = await self.local.settle(session)
        self._print_summary(accounting, self.local.clock.monotonic() - started)
        return accounting

    def _spec_toml(self) -> str:
        """The spec as ``shoal pipeline deploy FILE`` sends it (function files inlined)."""
        path = Path(self.config.spec_source)
        return inline_files(path.read_text("utf-8"), path.parent)

    def _start_view(self) -> ViewServer | None:
        """Serve the dashboard page (``shoal view``) and print its address."""
        if self.config.view_port is None:
            return None
        broker = self.local.broker
        user = self.local.users.get("dashboard")  # profiles with access control only
        config = PageConfig(
            ws_url=broker.ws_url, login=user is not None, username=user.name if user else ""
        )
        try:
            view = ViewServer(config, port=self.config.view_port).start()
        except ConfigError:  # the port is taken: any free one
            view = ViewServer(config, port=0).start()
        self._line(f"dashboard: {view.url} (MQTT over WebSockets: {broker.ws_url})")
        if user is not None:
            secret = self.local.run_dir / "dashboard-password"
            secret.touch(0o600)
            secret.write_text(user.password + "\n")
            self._line(f"  log in as {user.name}, with the password in {secret}")
        return view

    async def _start_scaler(self) -> MetricsServer | None:
        cfg = self.config
        if cfg.scale is None:
            return None
        self.scaler = Scaler(
            ScalerConfig(
                spec=cfg.spec,
                broker=self.local.broker.settings,
                topics=self.local.topics,
                policy=cfg.scale,
                bounds=cfg.bounds,
                http_port=cfg.metrics_port,
            ),
            self.local.backend,
            clock=self.local.clock,
            monitor=self.local.monitor,
            on_decision=self._on_decision,
        )
        if cfg.metrics_port is None:
            return None
        server = MetricsServer(
            self.scaler.render_metrics, self.scaler.render_json, "127.0.0.1", cfg.metrics_port
        )
        port = await server.start()
        self._line(f"scaler metrics on http://127.0.0.1:{port}/metrics and /api/v1/scaling")
        return server

    def _start_load(self) -> None:
        cfg = self.config
        if cfg.scenario is None:
            return
        if cfg.trace is not None:
            load = GatewayLoad(
                sensors=1000,
                rate=cfg.rate,
                batch=cfg.batch,
                encoding=cfg.encoding,
                attributes=cfg.spec.reads_attributes,
            )
            self._driver = TraceDriver(self.local, cfg.trace, load)
            self._driver.update(0.0)
            return
        self.local.start_simulator(
            [
                "--scenario",
                cfg.scenario,
                "--rate",
                str(cfg.rate),
                "--batch",
                str(cfg.batch),
                "--encoding",
                cfg.encoding,
                "--spool-dir",
                str(self.local.run_dir / "spool"),
                # Until we stop it (SIGINT makes it seal, send, wait for confirmations and
                # report).
                "--duration",
                str(365 * 86_400),
                "--wait-confirmed",
                str(SIMULATOR_CONFIRM_WAIT_S),
            ]
        )

    def _on_decision(self, record: ScaleRecord) -> None:
        before = record.signals.workers
        after = record.decision.desired
        if after == before:
            return
        when = dt.datetime.fromtimestamp(self.local.clock.now_ms() / 1000, tz=dt.UTC)
        text = f"{when:%H:%M:%S} workers {before} -> {after}: {record.decision.reason}"
        self.scale_log = [*self.scale_log[-4:], text]
        if not self._tty:
            self._line(f"scale: {text}")

    async def _show(self, started: float) -> None:
        # The duration is of load: it counts from the first measurements the monitor sees (a
        # simulator starting on a busy machine can take seconds to import), or from
        # LOAD_START_WAIT_S after the load was started if none come.
        clock = self.local.clock
        load_from, deadline = clock.monotonic(), None
        while not self._stop.is_set():
            now, snap = clock.monotonic(), self.local.monitor.snapshot()
            started_load = snap.rows_generated > 0 or now - load_from >= LOAD_START_WAIT_S
            if deadline is None and self.config.duration_s is not None and started_load:
                deadline = now + self.config.duration_s
            if deadline is not None and now >= deadline:
                return
            dead = self.local.dead_children()
            if dead:
                self._line(
                    f"component(s) exited unexpectedly: {', '.join(dead)}; see {self.local.logs}"
                )
                return
            elapsed = now - started
            if self._driver is not None:
                trace = self._driver.trace
                if elapsed >= trace.duration_s and self.config.duration_s is None:
                    self._line(f"trace {trace.name} finished")
                    return
                self._driver.update(elapsed)
            if self.scaler is not None:
                self.scaler.tick()
            self._draw(snap, elapsed)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.refresh_s):
                    await self._stop.wait()

    def _line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _draw(self, snap: Snapshot, elapsed: float) -> None:
        age = snap.oldest_unconfirmed_age_ms
        oldest = "-" if age is None else f"{age / 1000:.1f} s"
        event_time = pipeline_status(self.config.spec.name, snap, listened_s=0.0)
        refused = sum(p["partials_refused"] for p in event_time["partitions"])
        status = (
            f"[{elapsed:5.0f} s] in {snap.rows_in_per_s:>10,.0f}/s  "
            f"out {snap.rows_out_per_s:>10,.0f}/s  "
            f"workers {self._workers_text(snap)}  "
            f"lag {snap.lag_batches} batches / {snap.lag_rows:,} meas "
            f"(oldest {oldest})  windows {snap.windows_emitted}  late {snap.late_rows:,}  "
            f"dead letters {snap.deadletters}"
            + (f"  partials refused {refused:,}" if refused else "")
        )
        if not self._tty:
            self._line(status)
            # Piped output (CI logs, files) gets each new window's results once, for a few keys.
            fresh = [row for row in snap.latest if (row["window"], row["start"]) not in self._shown]
            self._shown = {(row["window"], row["start"]) for row in snap.latest}
            if fresh:
                self._line("\n".join(f"  result {self._result_text(row)}" for row in fresh))
            # ... and a line whenever a gateway's event-time state changes (bad clock, refused).
            notes = gateway_notes(event_time, durations=False)
            for gateway_id, note in sorted(notes.items()):
                if self._notes.get(gateway_id) != note:
                    self._line(f"  event time: gateway {gateway_id}: {note}")
            self._notes = notes
            return
        lines = [
            f"shoal up · pipeline {self.config.spec.name} · broker "
            f"{self.local.broker.settings.url} · logs {self.local.logs}",
            "",
            status,
            f"generated {snap.rows_generated:,}  applied {snap.batch_rows_applied:,}  "
            f"in results {snap.rows_in_results:,}",
            "",
            "workers:",
        ]
        for wid, body in sorted(snap.worker_metrics.items()):
            capacity = body.get("capacity_rows_per_s") or 0
            busy = 100 * float(body.get("busy_fraction", 0))
            lines.append(
                f"  {wid:50.50}  busy {busy:5.1f}%  capacity {capacity:>12,.0f} meas/s  "
                f"batches {body.get('batches', 0):,}"
            )
        if self.scaler is not None:
            lines += ["", f"scaling ({self.scaler.policy.name} policy):"]
            lines += [f"  {text}" for text in self.scale_log] or ["  no changes yet"]
        lines += ["", "event time:"]
        lines += [
            f"  partition {p['partition']}: {p['why']}{partition_notes(p)}"
            for p in event_time["partitions"]
        ]
        lines += [f"  {g}: {note}" for g, note in sorted(gateway_notes(event_time).items())]
        lines += ["", "latest results:"]
        lines += [f"  {self._result_text(row)}" for row in snap.latest]
        self.out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
        self.out.flush()

    def _result_text(self, row: dict[str, Any]) -> str:
        names = [a for a in self.config.spec.aggregate_names if a != "count"][:6]
        start = dt.datetime.fromtimestamp(int(row["start"]) / 1000, tz=dt.UTC)
        values = "  ".join(
            f"{n} {row[n]:.3f}" if isinstance(row.get(n), float) else f"{n} {row.get(n)}"
            for n in names
        )
        when = f"{row['window']} @{start:%H:%M:%S}"
        return f"{row['key']:>14}  {when}  n {row['rows']:>6}  {values}"

    def _workers_text(self, snap: Snapshot) -> str:
        live = len(snap.workers)
        if self.scaler is None or not self.scaler.history:
            return str(live)
        desired = self.scaler.history[-1].decision.desired
        gateways = "" if self._driver is None else f", {self._driver.gateways} gateways"
        return f"{live} (want {desired}{gateways})"

    def _print_summary(self, a: Accounting, seconds: float) -> None:
        rate = a.applied / seconds if seconds > 0 else 0.0
        snap = self.local.monitor.snapshot()
        self._line(
            "\nsummary\n"
            f"  ran {seconds:.1f} s; {snap.windows_emitted} window results\n"
            f"{self._scaling_summary()}"
            f"  measurements generated   {a.generated:>14,}\n"
            f"  applied                  {a.applied:>14,}  ({rate:,.0f}/s)\n"
            f"  counted in results       {a.in_results:>14,}\n"
            f"  late (reported)          {a.late:>14,}\n"
            f"  filtered (row stage)     {a.filtered:>14,}\n"
            f"  dead letters             {a.deadletters:>14,}\n"
            f"  unconfirmed batches      {a.unconfirmed_batches:>14,}\n"
            f"  lost                     {a.lost:>14,}\n"
            f"  duplicated               {a.duplicated:>14,}\n"
            f"  verdict: {'zero loss' if a.exact else 'LOSS OR DUPLICATES (see above)'}"
        )

    def _scaling_summary(self) -> str:
        if self.scaler is None:
            return ""
        stats = self.local.backend.stats
        return (
            f"  scaling ({self.scaler.policy.name}): {self.scaler.scale_events} changes, "
            f"{stats.started} workers started, {stats.drained} drained, "
            f"{stats.replaced} replaced after a crash, {stats.worker_seconds:,.0f} worker-seconds\n"
        )
