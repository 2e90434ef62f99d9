"""Follow a load trace with simulated gateways: start and stop groups of them as it says.

The first group (the trace's lowest level) runs for the whole trace. Each rise starts one
more ``shoal simulate`` process with the extra gateways; each fall stops the newest groups
(SIGINT: they seal and send their last batches, and wait for the pipeline to confirm them
before exiting, so stopping load never loses data). Every group has its own gateway ids.
"""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field

from shoal._processes import ChildProcess
from shoal.loadtest.trace import Trace
from shoal.runtime.local import LocalPipeline

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
