"""A whole pipeline on this machine: embedded broker, combiners, workers, simulated gateways.

Every part runs in its own process, as on a gateway box; ``LocalPipeline`` starts them, feeds
a ``PipelineMonitor`` with what they publish, and settles the run at the end: the simulator
seals and sends its last batches, every batch is confirmed, and the combiners close every
open window, so that every generated measurement is accounted for. ``shoal up`` draws it;
``shoal bench pipeline`` measures it; ``shoal bench chaos`` breaks it on purpose (``kill``,
``revive``, ``pause``, ``resume``, ``crash_broker``).

With a broker profile that has access control (``secure``), every component logs in with its
own role (random passwords, made per run) and gets its credentials by environment, never argv.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import orjson
import psutil

from shoal._processes import ChildProcess, connection_args, shoal_argv
from shoal._resources import resource_dir
from shoal.broker import AsyncSession
from shoal.broker.access import BrokerUser, Role
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import Session, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SystemClock
from shoal.errors import ConfigError, ControlError, UsageError
from shoal.processors.spec import PipelineSpec
from shoal.scaler.backends import LocalBackend
from shoal.scaler.monitor import PipelineMonitor, Snapshot
from shoal.schemas.topics import Topics

SETTLE_TIMEOUT_S: Final = 120.0
"""Settling gives up once the pipeline has applied nothing for this long."""
SETTLE_LIMIT_S: Final = 1_800.0
"""Settling gives up after this long in any case (a backlog that drains, slowly)."""
SIMULATOR_CONFIRM_WAIT_S: Final = SETTLE_LIMIT_S + 60.0
"""``--wait-confirmed`` for simulators that ``settle`` stops: they keep their gateways until
everything is confirmed (a memory spool is gone with its process, so a simulator that left
early would turn a backlog into loss); ``settle`` aborts them if it gives up first."""
LAST_STATUS_GRACE_S: Final = 0.5
"""How long ``settle`` lets the exited simulators' last gateway status reach the monitor."""
DEFAULT_SIMULATED_GATEWAYS: Final = tuple(f"sim-gw{i:03d}" for i in range(64))
RSS_EVERY_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class LocalPipelineConfig:
    """What to start.

    Attributes:
        spec: the pipeline.
        spec_source: how child processes find the spec (file path or name in processors/).
        workers: worker processes.
        profile: broker profile.
        run_dir: logs, spools and checkpoints (None: a temporary folder, removed at the end).
        per_key_results: publish the retained per-key result topics.
        gateway_ids: with an access-controlled profile, the gateway ids the simulators may
            publish for (they log in as one "concentrator" gateway user); empty: the
            simulator's default ids ``sim-gw000`` to ``sim-gw063``.
        broker_overrides: Mosquitto options that replace the profile's (tests, tuning).
        control_plane: also run the control plane (``shoal control``, process ``control``),
            so that ``shoal pipeline`` can be used against this broker; with access control
            it logs in with the ``control`` role.
        pool: run pool combiners (one per partition) and pool workers instead of components
            pinned to the spec (implies ``control_plane``); the spec is then not running until
            it is deployed through the control plane (``deploy``). Profiles without access
            control only (the component roles of an ACL profile name one pipeline).
    """

    spec: PipelineSpec
    spec_source: str
    workers: int = 2
    profile: str = "dev"
    run_dir: Path | None = None
    per_key_results: bool = True
    gateway_ids: tuple[str, ...] = ()
    broker_overrides: tuple[tuple[str, str], ...] = ()
    control_plane: bool = False
    pool: bool = False


@dataclass
class Accounting:
    """Where every generated measurement went, once a run has settled."""

    generated: int
    applied: int
    in_results: int
    late: int
    deadletters: int
    unconfirmed_batches: int
    window_memberships: int | None = None
    windows_per_row: int = 1
    unconfirmed_rows: int = 0
    """Measurements in batches the gateways still hold unconfirmed when settling ended."""
    waited_s: float = 0.0
    """How long settling waited for confirmations."""
    filtered: int = 0
    """Applied measurements the pipeline's row stage removed (``where``; in ``applied``)."""

    @property
    def drain_s(self) -> float | None:
        """From the end of the load until every batch was confirmed (None: some were not)."""
        return self.waited_s if self.unconfirmed_batches == 0 else None

    @property
    def lost(self) -> int:
        """Generated but neither applied (on time or late) nor still held by a gateway.

        Measurements of unconfirmed batches are not lost while their gateway holds them
        (``unconfirmed_rows``); a run that ends with any is not exact all the same.
        """
        return max(0, self.generated - self.applied - self.unconfirmed_rows)

    @property
    def duplicated(self) -> int:
        """Counted more than once (in window results or late reports).

        Exact for hopping windows too: every applied row must be counted in exactly
        ``windows_per_row`` windows (``window_memberships``, results plus late reports).
        """
        counted = self.applied - self.filtered  # rows the row stage removed are in no window
        if self.window_memberships is None:
            return max(0, self.in_results + self.late - counted)
        excess = self.window_memberships - counted * self.windows_per_row
        return 0 if excess <= 0 else -(-excess // self.windows_per_row)

    @property
    def exact(self) -> bool:
        """Nothing lost, nothing duplicated, nothing left unconfirmed."""
        return self.lost == 0 and self.duplicated == 0 and self.unconfirmed_batches == 0


@dataclass
class _Usage:
    name: str
    process: psutil.Process
    cpu_start: float
    wall_start: float
    cpu_last: float = 0.0
    rss_peak: int = 0
    rss_last: int = 0
    restarts: int = 0
    rss_series: list[int] = field(default_factory=list)
    """RSS every ``RSS_EVERY_S`` (growth over a long run shows here)."""
    next_series_at: float = 0.0


@dataclass
class ResourceSampler:
    """CPU seconds and peak RSS of named processes over a run (sampled, psutil).

    ``monotonic`` is the wall-time clock the CPU shares are measured against.
    """

    usages: dict[str, _Usage] = field(default_factory=dict)
    monotonic: Callable[[], float] = time.monotonic

    def watch(self, name: str, pid: int | None) -> None:
        """Start measuring a process; a name seen before (a restart) keeps its totals."""
        if pid is None:
            return
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            times = process.cpu_times()
            usage = _Usage(name, process, times.user + times.system, self.monotonic())
            before = self.usages.get(name)
            if before is not None and before.process.pid != pid:
                # CPU and peak memory are per component, over all its incarnations.
                usage.cpu_start -= before.cpu_last - before.cpu_start
                usage.cpu_last = usage.cpu_start + (before.cpu_last - before.cpu_start)
                usage.wall_start = before.wall_start
                usage.rss_peak = before.rss_peak
                usage.restarts = before.restarts + 1
            self.usages[name] = usage

    def sample(self) -> None:
        """Take one sample of every watched process."""
        for usage in self.usages.values():
            with contextlib.suppress(psutil.Error):
                times = usage.process.cpu_times()
                usage.cpu_last = times.user + times.system
                usage.rss_last = usage.process.memory_info().rss
                usage.rss_peak = max(usage.rss_peak, usage.rss_last)
                now = self.monotonic()
                if now >= usage.next_series_at:
                    usage.rss_series.append(usage.rss_last)
                    usage.next_series_at = now + RSS_EVERY_S

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) of every watched process so far, read now."""
        out = {}
        for name, usage in self.usages.items():
            with contextlib.suppress(psutil.Error):
                times = usage.process.cpu_times()
                out[name] = times.user + times.system
        return out

    def report(self) -> list[dict[str, object]]:
        """Per process: name, CPU % of one core over the run, peak RSS in MB."""
        now = self.monotonic()
        out = []
        for usage in self.usages.values():
            wall = max(now - usage.wall_start, 1e-9)
            out.append(
                {
                    "name": usage.name,
                    "cpu_percent": round(100.0 * (usage.cpu_last - usage.cpu_start) / wall, 1),
                    "cpu_seconds": round(usage.cpu_last - usage.cpu_start, 3),
                    "rss_mb": round(usage.rss_peak / 1e6, 1),
                    "rss_last_mb": round(usage.rss_last / 1e6, 1),
                    f"rss_every_{RSS_EVERY_S:.0f}s_mb": [
                        round(r / 1e6, 1) for r in usage.rss_series
                    ],
                    "restarts": usage.restarts,
                }
            )
        return out


class LocalPipeline:
    """Broker, combiners and workers as child processes, and a monitor watching them.

    ``clock``: the time the monitor, the backend and the waits here read (default: the real one).
    """

    def __init__(self, config: LocalPipelineConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.topics = Topics()
        self.run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="shoal-run-"))
        self.users = _role_users(config)
        self.broker = EmbeddedBroker(
            config.profile,
            data_dir=self.run_dir / "broker",
            users=list(self.users.values()),
            overrides=dict(config.broker_overrides),
            websockets=True,  # for the page of `shoal view` (shoal up serves it)
        )
        self.children: list[ChildProcess] = []
        self.simulators: list[ChildProcess] = []
        self.backend = LocalBackend(self._spawn_worker, clock=self.clock.monotonic)
        self._worker_numbers = itertools.count()
        self.monitor = PipelineMonitor(config.spec, self.topics, self.clock)
        self.sampler = ResourceSampler(monotonic=self.clock.monotonic)

    @property
    def logs(self) -> Path:
        """Where child processes write their output."""
        return self.run_dir / "logs"

    def start(self) -> None:
        """Broker first, then combiners (and the control plane), then workers."""
        self.broker.start()
        self.sampler.watch("broker", self.broker.pid)
        spec = self.config.spec
        conn = connection_args(self.broker.settings, self.topics)
        if self.config.pool:
            self._start_pool(conn)
            return
        for p in range(spec.partitions):
            argv = [
                "combiner",
                "--pipeline",
                self.config.spec_source,
                "--partition",
                str(p),
                "--state-dir",
                str(self.run_dir / "state" / f"combiner-{p}"),
                *conn,
            ]
            if not self.config.per_key_results:
                argv.append("--no-key-topics")
            self._start_child(f"combiner-{p}", argv)
        if self.config.control_plane:
            self._start_child("control", ["control", *conn])
        self.backend.scale_to(self.config.workers)

    def _start_pool(self, conn: list[str]) -> None:
        if self.users:
            raise ConfigError(
                f"profile {self.config.profile!r} has access control: its component roles "
                "name one pipeline, so it runs pinned components only"
            )
        self._start_child("control", ["control", *conn])
        for p in range(self.config.spec.partitions):
            argv = ["combiner", "--id", f"combiner-{p}", "--state-dir", str(self.run_dir / "state")]
            if not self.config.per_key_results:
                argv.append("--no-key-topics")
            self._start_child(f"combiner-{p}", [*argv, *conn])
        self.backend.scale_to(self.config.workers)

    async def deploy(self, spec_toml: str, timeout_s: float = 30.0) -> str:
        """Deploy ``spec_toml`` through the control plane, as ``shoal pipeline deploy`` does.

        Returns once a pool worker serves the version and pool combiners own its partitions;
        raises ``ControlError`` when refused or not running in time.
        """
        from shoal.control.client import ControlClient  # noqa: PLC0415
        from shoal.control.messages import Request  # noqa: PLC0415

        control = self.process("control")
        deadline = self.clock.monotonic() + timeout_s
        # A request sent before the control plane subscribed would go unanswered.
        while "shoal control: ready" not in control.log_tail():
            if not control.alive() or self.clock.monotonic() > deadline:
                raise ControlError(
                    f"the control plane did not start: {control.log_tail()}", reason="timeout"
                )
            await asyncio.sleep(0.1)
        client = ControlClient(self.credentials("admin"), self.topics, timeout_s=timeout_s)
        result = await client.request(Request("deploy", uuid.uuid4().hex, spec_toml=spec_toml))
        if not result.ok or result.name is None or result.version is None:
            raise ControlError(
                result.message, reason=result.reason or "refused", field=result.field
            )
        name, version = result.name, result.version
        if result.alias_of is not None:
            name, version = result.alias_of, 1
        workers = await client.served(name, version)
        await client.owned(name, version)
        return f"{result.message}; served by pool worker(s) {', '.join(workers)}"

    @property
    def workers(self) -> list[ChildProcess]:
        """Live workers (the backend replaces crashed ones and drains surplus ones)."""
        return self.backend.live

    @property
    def simulator(self) -> ChildProcess | None:
        """The first simulator started, if any."""
        return self.simulators[0] if self.simulators else None

    def _spawn_worker(self) -> ChildProcess:
        name = f"worker-{next(self._worker_numbers)}"
        conn = connection_args(self.broker.settings, self.topics)
        pinned = () if self.config.pool else ("--pipeline", self.config.spec_source)
        child = ChildProcess(
            name,
            shoal_argv("worker", *pinned, *conn),
            self.logs / f"{name}.log",
            self._child_env("worker"),
        )
        child.start()
        self.sampler.watch(name, child.pid)
        return child

    def start_simulator(self, args: list[str], name: str = "simulator") -> ChildProcess:
        """Start ``shoal simulate`` with ``args`` against this broker.

        A pipeline keyed on an attribute, or whose row stage reads one, gets gateways that
        send the attributes. A simulator that ``settle`` is to account exactly keeps its
        gateways until everything it sent is confirmed: give it ``--wait-confirmed`` (``up``
        and the benchmarks pass ``SIMULATOR_CONFIRM_WAIT_S``).
        """
        conn = connection_args(self.broker.settings, self.topics)
        if self.config.spec.reads_attributes and "--attributes" not in args:
            args = [*args, "--attributes"]
        simulator = ChildProcess(
            name,
            shoal_argv("simulate", *args, *conn),
            self.logs / f"{name}.log",
            self.credentials("simulator").child_env(),
        )
        simulator.start()
        self.simulators.append(simulator)
        self.sampler.watch(name, simulator.pid)
        return simulator

    def _child_env(self, role: str = "") -> dict[str, str]:
        # Children log to files: INFO there costs nothing and explains what happened.
        return {
            "POLARS_MAX_THREADS": os.environ.get("POLARS_MAX_THREADS", "1"),
            "SHOAL_LOG_LEVEL": os.environ.get("SHOAL_CHILD_LOG_LEVEL", "INFO"),
            **self.credentials(role).child_env(),
        }

    def credentials(self, role: str) -> BrokerSettings:
        """How a component of ``role`` (combiner, worker, admin, simulator) reaches the broker.

        The address comes from the broker; the credentials exist only with a profile that has
        access control (otherwise: none, anonymous).
        """
        user = self.users.get(role)
        settings = self.broker.settings
        return settings if user is None else settings.with_credentials(user.name, user.password)

    def _start_child(self, name: str, argv: list[str]) -> ChildProcess:
        role = name.split("-", 1)[0]
        child = ChildProcess(
            name, shoal_argv(*argv), self.logs / f"{name}.log", self._child_env(role)
        )
        child.start()
        self.children.append(child)
        self.sampler.watch(name, child.pid)
        return child

    # -- faults, for ``shoal bench chaos`` ------------------------------------------------------

    def process(self, name: str) -> ChildProcess:
        """A component by name (``combiner-0``, ``control``, ``worker-3``, a simulator's name)."""
        for child in (*self.children, *self.backend.live, *self.simulators):
            if child.name == name:
                return child
        raise UsageError(f"no component named {name!r}")

    def kill(self, name: str) -> None:
        """SIGKILL a component (a crash). The backend replaces killed workers on its own."""
        self.process(name).kill()

    def revive(self, name: str) -> None:
        """Start a killed component again, with the same command line and state folder."""
        child = self.process(name)
        if not child.alive():
            child.start()
            self.sampler.watch(name, child.pid)

    def pause(self, name: str) -> ChildProcess:
        """SIGSTOP a component: alive, connected, silent (a network pause); returns it."""
        child = self.process(name)
        child.signal(signal.SIGSTOP)
        return child

    def resume(self, child: ChildProcess) -> None:
        """SIGCONT a paused component (nothing if it has died meanwhile)."""
        child.signal(signal.SIGCONT)

    def crash_broker(self, down_s: float = 1.0) -> None:
        """SIGKILL mosquitto, wait ``down_s``, start it again on the same port and data."""
        self.broker.kill()
        time.sleep(down_s)
        self.broker.start()
        self.sampler.watch("broker", self.broker.pid)

    def dead_children(self) -> list[str]:
        """Names of pipeline processes (combiners) that exited; workers are replaced instead."""
        return [c.name for c in self.children if not c.alive()]

    def stop(self) -> None:
        """Stop everything (children, then the broker) and clean up a temporary run folder."""
        for simulator in self.simulators:
            simulator.stop()
        self.backend.close()
        for child in reversed(self.children):
            child.stop()
        self.broker.close()
        if self.config.run_dir is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[Session]:
        """Feed the monitor (and sample resources) while the body runs."""
        async with AsyncSession(
            self.credentials("admin"), unique_client_id("shoal-monitor")
        ) as session:
            await session.subscribe(self.monitor.filters(), qos=0)

            async def feed() -> None:
                async for message in session.messages():
                    self.monitor.on_message(message)

            async def sample() -> None:
                while True:
                    self.sampler.sample()
                    self.backend.observe()  # reap drained workers, replace crashed ones
                    await asyncio.sleep(0.5)

            tasks = [asyncio.create_task(feed()), asyncio.create_task(sample())]
            try:
                yield session
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(
        self,
        session: Session,
        timeout_s: float = SETTLE_TIMEOUT_S,
        *,
        progress: Callable[[float, Snapshot], None] | None = None,
    ) -> Accounting:
        """Stop the simulators, wait until their backlog is confirmed, flush windows, account.

        Stopped simulators seal what they hold and keep their gateways until every batch is
        confirmed (started with ``--wait-confirmed SIMULATOR_CONFIRM_WAIT_S``), so a backlog
        drains at the pipeline's pace. The wait lasts while the pipeline makes progress: it
        gives up after ``timeout_s`` in which nothing was applied, or after
        ``SETTLE_LIMIT_S``. ``progress`` is called about every two seconds while it waits.
        """
        stopped = self.clock.monotonic()
        for simulator in self.simulators:
            if simulator.alive():
                simulator.signal(signal.SIGINT)
        exited_at: list[float] = []

        def drained(snap: Snapshot) -> bool:
            # A stopped simulator seals what it holds and exits once all of it is confirmed,
            # after publishing its gateways' last status; until then the monitor's lag may be
            # from before that last batch (lag 0 at the very moment of the signal). So: every
            # simulator gone, its last status given a moment to arrive, and no lag left.
            if any(simulator.alive() for simulator in self.simulators):
                return False
            if not exited_at:
                exited_at.append(self.clock.monotonic())
            # (A simulator that died before generating anything leaves nothing to wait for.)
            settled = self.clock.monotonic() - exited_at[0] >= LAST_STATUS_GRACE_S
            return settled and snap.lag_batches == 0

        await self._drain(drained, timeout_s, progress)
        waited = self.clock.monotonic() - stopped
        for simulator in self.simulators:
            await asyncio.to_thread(simulator.wait, 10.0)
            if simulator.alive():  # it is still waiting for confirmations: abort it
                simulator.signal(signal.SIGINT)
                await asyncio.to_thread(simulator.wait, 10.0)
        await session.publish(
            self.topics.combiner_control(self.config.spec.name), orjson.dumps({"cmd": "flush"})
        )
        await self.until(
            lambda s: (
                s.window_memberships >= (s.batch_rows_applied - _filtered(s)) * s.windows_per_row
                and s.batch_rows_applied >= s.rows_generated
            ),
            min(timeout_s, 30.0),
        )
        await asyncio.sleep(0.5)  # late duplicates, if any, would show up now
        snap = self.monitor.snapshot()
        return Accounting(
            generated=snap.rows_generated,
            applied=snap.batch_rows_applied,
            in_results=snap.rows_in_results,
            late=snap.late_rows,
            window_memberships=snap.window_memberships,
            windows_per_row=snap.windows_per_row,
            deadletters=snap.deadletters,
            unconfirmed_batches=snap.lag_batches,
            unconfirmed_rows=snap.lag_rows,
            waited_s=round(waited, 2),
            filtered=_filtered(snap),
        )

    async def _drain(
        self,
        done: Callable[[Snapshot], bool],
        stall_s: float,
        progress: Callable[[float, Snapshot], None] | None,
    ) -> None:
        """Wait until ``done`` while rows keep being applied (see ``settle``)."""
        started = last_progress = self.clock.monotonic()
        applied = self.monitor.snapshot().batch_rows_applied
        next_report = started + 2.0
        while True:
            snap = self.monitor.snapshot()
            if done(snap):
                return
            now = self.clock.monotonic()
            if snap.batch_rows_applied != applied:
                applied, last_progress = snap.batch_rows_applied, now
            if now - last_progress >= stall_s or now - started >= SETTLE_LIMIT_S:
                return
            if progress is not None and now >= next_report:
                next_report = now + 2.0
                progress(now - started, snap)
            await asyncio.sleep(0.25)

    async def until(self, done: Callable[[Snapshot], bool], timeout_s: float) -> bool:
        """Wait until ``done(snapshot)`` or the timeout."""
        deadline = self.clock.monotonic() + timeout_s
        while self.clock.monotonic() < deadline:
            if done(self.monitor.snapshot()):
                return True
            await asyncio.sleep(0.25)
        return False


def _role_users(config: LocalPipelineConfig) -> dict[str, BrokerUser]:
    """One user per component role, for profiles with access control (none otherwise)."""
    template = resource_dir("broker") / f"{config.profile}.acl"
    if not template.is_file():
        return {}
    spec = config.spec
    roles = {
        "combiner": Role.combiner(spec.name),
        "worker": Role.worker(spec.name, spec.inputs),
        "admin": Role.admin(),
        "dashboard": Role.dashboard(spec.name),  # the page of `shoal up` (shoal view)
        # The simulator's gateways (``shoal simulate``'s default ids, unless told otherwise).
        "simulator": Role.gateway(*(config.gateway_ids or DEFAULT_SIMULATED_GATEWAYS)),
    }
    if config.control_plane:
        roles["control"] = Role.control()
    return {
        kind: BrokerUser(f"shoal-{kind}-{spec.name}", secrets.token_urlsafe(18), role)
        for kind, role in roles.items()
    }


def _filtered(snap: Snapshot) -> int:
    """Applied measurements the row stage removed (partition 0's count, like ``batch_rows``)."""
    return int(snap.combiners.get(0, {}).get("rows_filtered", 0))
