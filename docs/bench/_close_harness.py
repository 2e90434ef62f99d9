"""What the close-path CPU harnesses share (``count_close_cpu.py``, ``sliding_close_cpu.py``).

A ``Scenario``: scenario B's partials for one window preset of the default pipeline (10
gateways, 16,000-row batches), made once as a worker makes them and cached in the temporary
folder, and a ``Combiner`` core to drive with them; CPU timers that count the outermost
timed call only; and the alternation of two trees, a base checkout's ``src`` and this
tree's, each repeat in a fresh process, reported as medians per part.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import polars as pl

from shoal._resources import resource_dir
from shoal.clock import FakeClock
from shoal.loadtest.bench_windows import with_window
from shoal.loadtest.data import SensorField
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.spec import parse_pipeline
from shoal.schemas import Encoding, decode_batch, encode_batch
from shoal.schemas.control import GatewayStatus

GATEWAYS = 10
BATCH = 16_000
START_MS = 1_700_000_000_000
OWN_SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass(frozen=True)
class Scenario:
    """Scenario B with ``sensors`` per gateway at ``rate_hz`` each, for ``seconds``."""

    cache_name: str
    window: str
    sensors: int
    rate_hz: float
    seconds: int
    batch: int = BATCH  # rows per gateway batch; a round lasts as long as one takes to fill

    @property
    def cache(self) -> Path:
        name = f"{self.cache_name}-partials-{self.sensors}-{self.rate_hz}-{self.seconds}"
        if self.batch != BATCH:
            name += f"-{self.batch}"
        name += ".msgpack"
        return Path(tempfile.gettempdir()) / name

    def spec(self) -> Any:
        """The default pipeline with this scenario's window preset."""
        raw = tomllib.loads((resource_dir("processors") / "default.toml").read_text())
        return parse_pipeline({**with_window(raw, self.window), "limits": {"max_future_ms": False}})

    def make_partials(self) -> None:
        """Every round's encoded partials, as a worker makes them (cached across runs)."""
        if self.cache.exists():
            return
        fields = [
            SensorField(f"gw{g:02d}", self.sensors, self.rate_hz, START_MS, seed=g)
            for g in range(GATEWAYS)
        ]
        builder = PartialBuilder(self.spec(), "w")
        tick_ms = int(self.batch / (self.sensors * self.rate_hz) * 1000)
        now = START_MS
        rounds: list[list[bytes]] = []
        for seq in range(int(self.seconds * 1000 / tick_ms)):
            now += tick_ms
            batch = []
            for field in fields:
                payload = encode_batch(
                    field.take(now), gateway_id=field.gateway_id, seq=seq, sent_at_ms=0,
                    encoding=Encoding.BINARY_COLUMNAR,
                )  # fmt: skip
                info = BatchInfo(field.gateway_id, seq, "s", 0, None, None, 0, 0, "w")
                batch += [p.encode() for p in builder.build_batch(decode_batch(payload), info, 0)]
            rounds.append(batch)
        self.cache.write_bytes(msgpack.packb([tick_ms, rounds]))

    def load(self) -> tuple[int, list[list[bytes]]]:
        """(tick in ms, every round's encoded partials)."""
        tick_ms, rounds = msgpack.unpackb(self.cache.read_bytes())
        return int(tick_ms), rounds

    def combiner(self) -> tuple[Combiner, FakeClock]:
        """A combiner core on an injected clock, every gateway announced."""
        clock = FakeClock()
        combiner = Combiner(self.spec(), 0, clock, memory_bytes=None)
        for g in range(GATEWAYS):
            status = GatewayStatus(f"gw{g:02d}", "s", 0, 0, 0, 0, None, 0, 0, START_MS)
            combiner.receive_status(status)
        return combiner, clock

    def closed_frames(
        self, totals: dict[str, float], *, close_each: bool = False
    ) -> Iterator[pl.DataFrame]:
        """Drive a fresh combiner over the cached partials; every non-empty closed frame.

        Round by round: the round's partials (decoded beforehand, not timed), then a tick
        after the round's span of the clock. The CPU seconds of ``receive`` and ``tick`` go
        to ``totals["combiner"]``. ``close_each``: also ``close_ready`` after every partial,
        as the runtime does after each message (the clock advanced by an equal share of the
        round before each).
        """
        tick_ms, rounds = self.load()
        combiner, clock = self.combiner()
        for batch in rounds:
            decoded = [Partial.decode(p) for p in batch]
            began = time.process_time()
            share = tick_ms // (len(decoded) + 1) if close_each else 0
            for partial in decoded:
                combiner.receive(partial)
                if close_each:
                    clock.advance(share)
                    closed = combiner.close_ready(clock.now_ms())
                    if closed is not None and not closed.empty:
                        totals["combiner"] += time.process_time() - began
                        yield closed.frame
                        began = time.process_time()
            clock.advance(tick_ms - share * len(decoded))
            closed = combiner.tick().closed
            totals["combiner"] += time.process_time() - began
            if closed is not None and not closed.empty:
                yield closed.frame


_DEPTH = [0]  # shared by the timers: a CPU second counts for the outermost timed call only


def timed(owner: type, name: str, totals: dict[str, float], label: str) -> None:
    """Wrap ``owner.name`` to add its CPU seconds to ``totals[label]`` (outermost call only)."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _DEPTH[0]:
            return inner(*args, **kwargs)
        _DEPTH[0] += 1
        began = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.process_time() - began
            _DEPTH[0] -= 1

    setattr(owner, name, wrapper)


def alternate(
    script: Path,
    base_src: str,
    repeats: int,
    parts: Sequence[str],
    extra: Callable[[dict[str, float]], dict[str, float]] | None = None,
) -> None:
    """Run ``script --once`` ``repeats`` times per tree, alternating; print medians per part.

    ``script --make`` (this tree) makes the partials first. ``extra``: more figures from the
    medians.
    """
    env = {**os.environ, "PYTHONPATH": str(OWN_SRC)}
    subprocess.run([sys.executable, str(script), "--make"], check=True, env=env)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    for _ in range(repeats):
        for name, src in (("base", base_src), ("this", str(OWN_SRC))):
            out = subprocess.run(
                [sys.executable, str(script), "--once"],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": src},
            ).stdout
            runs[name].append(json.loads(out))
    for name, records in runs.items():
        first = records[0]
        medians = {k: round(statistics.median(r[k] for r in records), 7) for k in parts}
        report = {
            "tree": name,
            "steps": first["steps"],
            "results": first["results"],
            "digests": sorted({r["digest"] for r in records}),
            "cpu_s_per_step_median": medians,
            **(extra(medians) if extra else {}),
            "load": os.getloadavg(),
        }
        sys.stdout.write(json.dumps(report) + "\n")


def main(
    script: Path,
    scenario: Scenario,
    run_once: Callable[[], dict[str, Any]],
    parts: Sequence[str],
    extra: Callable[[dict[str, float]], dict[str, float]] | None = None,
) -> None:
    """A harness's command line: ``--make``, ``--once``, or ``BASE_SRC [REPEATS]`` (5)."""
    args = sys.argv[1:]
    if args == ["--make"]:
        scenario.make_partials()
    elif args == ["--once"]:
        sys.stdout.write(json.dumps(run_once()) + "\n")
    else:
        alternate(script, args[0], int(args[1]) if len(args) > 1 else 5, parts, extra)
