"""Load traces, and following one with simulated gateways.

A trace says how many simulated gateways publish at each moment of a run: a list of phases,
each a number of gateways from a moment on. The scaling benchmark and ``shoal up --trace``
drive the research's scenarios over time (scenario A is one gateway of 1,000 sensors,
scenario B ten of them):

* ``step``: A, then B, then A again (the research's step from a factory to a city).
* ``ramp``: A, then one more group of gateways every few seconds up to B, then back down.
* ``spike``: A, a short burst of B, then A.

``Trace`` and ``make_trace`` are pure. ``TraceDriver`` follows a trace: the first group (the
trace's lowest level) runs for the whole trace. Each rise starts one more ``shoal simulate``
process with the extra gateways; each fall stops the newest groups (SIGINT: they seal and send
their last batches, and wait for the pipeline to confirm them before exiting, so stopping load
never loses data). Every group has its own gateway ids.

Lives in the runtime (``shoal up`` follows traces), never imports ``shoal.loadtest``.
"""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field
from typing import Final

from shoal._processes import ChildProcess
from shoal.errors import TraceError
from shoal.runtime.local import LocalPipeline

TRACES: Final = ("step", "ramp", "spike")


@dataclass(frozen=True, slots=True)
class Phase:
    """From ``at_s`` (seconds after the trace starts) on, ``gateways`` gateways publish."""

    at_s: float
    gateways: int
    label: str


@dataclass(frozen=True, slots=True)
class Trace:
    """A load trace: phases in time order, and when it ends."""

    name: str
    phases: tuple[Phase, ...]
    duration_s: float

    def __post_init__(self) -> None:
        """Refuse traces that cannot run."""
        if not self.phases or self.phases[0].at_s != 0:
            raise TraceError("a trace starts with a phase at 0 s")
        times = [p.at_s for p in self.phases]
        if times != sorted(times) or len(set(times)) != len(times):
            raise TraceError("phases must be in strictly increasing time order")
        if self.duration_s <= times[-1]:
            raise TraceError("the trace must end after its last phase starts")
        if any(p.gateways < 1 for p in self.phases):
            raise TraceError("every phase needs at least one gateway")

    def phase_at(self, t_s: float) -> Phase:
        """The phase in force ``t_s`` seconds into the trace."""
        current = self.phases[0]
        for phase in self.phases:
            if phase.at_s <= t_s:
                current = phase
        return current

    @property
    def max_gateways(self) -> int:
        """The most gateways publishing at once."""
        return max(p.gateways for p in self.phases)

    def steps_up(self) -> list[float]:
        """Moments at which the load rises."""
        return [
            b.at_s
            for a, b in zip(self.phases, self.phases[1:], strict=False)
            if b.gateways > a.gateways
        ]

    def scaled(self, factor: float) -> Trace:
        """The same trace with every duration multiplied by ``factor`` (shorter runs)."""
        if factor <= 0:
            raise TraceError("factor must be positive")
        return Trace(
            self.name,
            tuple(Phase(p.at_s * factor, p.gateways, p.label) for p in self.phases),
            self.duration_s * factor,
        )


def make_trace(
    name: str,
    *,
    low: int = 1,
    high: int = 10,
    warmup_s: float = 40.0,
    high_s: float = 90.0,
    cooldown_s: float = 70.0,
) -> Trace:
    """A named trace between ``low`` and ``high`` gateways (scenario A and B by default).

    ``warmup_s`` at ``low``, then ``high`` for ``high_s`` (the whole ramp for ``ramp``, a
    sixth of it for ``spike``), then ``low`` for ``cooldown_s``.
    """
    if not 1 <= low < high:
        raise TraceError(f"need 1 <= low ({low}) < high ({high})")
    if name in ("step", "spike"):
        held_s = high_s if name == "step" else max(5.0, high_s / 6)
        phases = [
            Phase(0.0, low, "A"),
            Phase(warmup_s, high, "B"),
            Phase(warmup_s + held_s, low, "A"),
        ]
        return Trace(name, tuple(phases), warmup_s + held_s + cooldown_s)
    if name == "ramp":
        # Up in three groups over the first half, hold, down in three groups over the last half.
        levels = _ramp_levels(low, high)
        up = high_s / 2
        step_s = up / len(levels)
        phases = [Phase(0.0, low, "A")]
        phases += [
            Phase(warmup_s + i * step_s, g, "B" if g == high else "ramp")
            for i, g in enumerate(levels)
        ]
        down = [*reversed(levels[:-1]), low]
        start_down = warmup_s + up + high_s / 4
        phases += [
            Phase(start_down + i * step_s / 2, g, "A" if g == low else "ramp")
            for i, g in enumerate(down)
        ]
        return Trace(name, tuple(phases), phases[-1].at_s + cooldown_s)
    raise TraceError(f"unknown trace {name!r}; choose one of {', '.join(TRACES)}")


def _ramp_levels(low: int, high: int, groups: int = 3) -> list[int]:
    """``groups`` evenly spaced gateway counts above ``low``, ending at ``high``."""
    span = high - low
    levels = sorted({low + round(span * (i + 1) / groups) for i in range(groups)})
    return [g for g in levels if g > low]


CONFIRM_WAIT_S = 60.0
"""How long a stopped group waits for its last batches to be confirmed."""


@dataclass(frozen=True, slots=True)
class GatewayLoad:
    """What each simulated gateway sends.

    Attributes:
        sensors: sensors per gateway.
        rate: measurements per second per sensor.
        batch: rows per batch.
        encoding: batch encoding.
        attributes: measurements carry name, type and unit.
        spool: gateway spool (``disk`` or ``memory``).
    """

    sensors: int = 1000
    rate: float = 25.0
    batch: int = 16_000
    encoding: str = "binary"
    attributes: bool = False
    spool: str = "disk"


@dataclass
class _Group:
    process: ChildProcess
    gateways: int


@dataclass
class TraceDriver:
    """Keeps the number of publishing gateways at what the trace says (see module docstring)."""

    local: LocalPipeline
    trace: Trace
    load: GatewayLoad = field(default_factory=GatewayLoad)
    groups: list[_Group] = field(default_factory=list)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def gateways(self) -> int:
        """Gateways currently publishing."""
        return sum(g.gateways for g in self.groups)

    def update(self, t_s: float) -> int:
        """Start or stop groups for the phase in force at ``t_s``; returns the gateway count."""
        target = self.trace.phase_at(t_s).gateways
        while self.gateways > target and len(self.groups) > 1:
            group = self.groups.pop()
            if group.process.alive():
                group.process.signal(signal.SIGINT)
        if self.gateways < target:
            self._start(target - self.gateways)
        return self.gateways

    def _start(self, gateways: int) -> None:
        number = next(self._numbers)
        load = self.load
        spool = self.local.run_dir / "spool" / f"group-{number}"
        args = [
            "--gateways",
            str(gateways),
            "--gateway-prefix",
            f"sim-g{number}-",
            "--seed",
            str(1000 * number),
            "--sensors",
            str(load.sensors),
            "--rate",
            str(load.rate),
            "--batch",
            str(load.batch),
            "--encoding",
            load.encoding,
            "--spool",
            load.spool,
            *(["--spool-dir", str(spool)] if load.spool == "disk" else []),
            *(["--attributes"] if load.attributes else []),
            "--wait-confirmed",
            str(CONFIRM_WAIT_S),
            "--duration",
            str(365 * 86_400),  # until stopped
            "--quiet",
        ]
        process = self.local.start_simulator(args, name=f"simulator-{number}")
        self.groups.append(_Group(process, gateways))
