"""``shoal bench memory``: combiner and worker RSS as a function of keys and open windows.

Each figure is measured in a fresh process (``spawn``), so one does not inherit another's
heap. The process imports shoal, warms up on a small batch, notes its RSS, then:

* **combiner**: builds the partials of ``keys`` distinct keys, each with
  ``rows_per_key`` rows in each of ``windows`` open windows, in batches of ``batch`` rows
  (as a worker would), and applies them to a combiner core (``Combiner``, no broker) without
  closing any window; then merges the state and notes RSS again. The difference over
  ``keys x windows`` is the bytes one key costs per open window, the transient partial of
  one batch included.
* **worker**: builds the same partials and drops each after building it (a worker keeps
  nothing across batches); the peak RSS over the baseline shows what a worker needs, which
  depends on the batch size, not on the keys.

RSS is read from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MB of 10^6 bytes.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import polars as pl

from shoal.clock import FakeClock
from shoal.processors.combine import Combiner
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.schemas import FRAME_SCHEMA
from shoal.schemas.control import GatewayStatus

T0 = 1_700_000_000_000
MB = 1_000_000


@dataclass(frozen=True, slots=True)
class MemoryFigure:
    """One measurement: a role's RSS with ``keys`` keys in ``windows`` open windows."""

    role: str
    keys: int
    windows: int
    rows: int
    state_cells: int
    baseline_mb: float
    rss_mb: float
    peak_mb: float

    @property
    def bytes_per_key_window(self) -> float:
        """RSS over the baseline per key and open window."""
        return (self.rss_mb - self.baseline_mb) * MB / (self.keys * self.windows)

    def as_record(self) -> dict[str, object]:
        """The figure as a JSON-ready record."""
        return {**asdict(self), "bytes_per_key_window": round(self.bytes_per_key_window, 1)}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _names(keys: int) -> pl.Series:
    return pl.Series([f"s{i:07d}" for i in range(keys)], dtype=pl.String)


def _batches(
    spec: PipelineSpec, names: pl.Series, windows: int, rows_per_key: int, batch: int
) -> Iterator[pl.DataFrame]:
    """Frames of ``batch`` rows: every key ``rows_per_key`` times in each window, in time order."""
    size = spec.windows[0].size_ms
    keys = len(names)
    rng = np.random.default_rng(7)
    for w in range(windows):
        for r in range(rows_per_key):
            for offset in range(0, keys, batch):
                n = min(batch, keys - offset)
                ts = T0 + w * size + (r * size) // rows_per_key + np.arange(n) % 10
                yield pl.DataFrame(
                    {
                        "sensor_id": names.slice(offset, n),
                        "ts": ts,
                        "value": rng.normal(20.0, 5.0, n),
                        "name": None,
                        "type": None,
                        "unit": None,
                    },
                    schema=FRAME_SCHEMA,
                )


def _measure(job: tuple[PipelineSpec, str, int, int, int, int]) -> MemoryFigure:
    spec, role, keys, windows, rows_per_key, batch = job
    builder = PartialBuilder(spec, "bench")
    clock = FakeClock(T0)
    core = Combiner(spec, 0, clock, logged=False) if role == "combiner" else None
    if core is not None:
        core.receive_status(GatewayStatus("g", "s", 1 << 40, 0, 1 << 40, 0, None, 0, 0, 0))
    names = _names(keys)  # the input's keys: the test's, not the role's, memory
    # warm up: every code path once, then forgotten
    warm = Combiner(spec, 0, clock, logged=False) if core is not None else None
    for frame in _batches(spec, _names(min(keys, batch)), 1, 1, batch):
        info = BatchInfo("w", 0, "s", frame.height, None, None, 0, 0, "b")
        part = builder.build(frame, info, clock.now_ms())[0]
        if warm is not None:
            warm.receive(part)
            warm.state.compact()
    del warm
    gc.collect()
    baseline = _status_mb("VmRSS")
    for seq, frame in enumerate(_batches(spec, names, windows, rows_per_key, batch)):
        max_ts = int(frame["ts"].to_numpy().max())
        info = BatchInfo("g", seq, "s", frame.height, None, max_ts, 0, 0, "b")
        partial = builder.build(frame, info, clock.now_ms())[0]
        if core is not None:
            core.receive(partial)
        del partial
    if core is not None:
        core.state.compact()
    gc.collect()
    return MemoryFigure(
        role=role,
        keys=keys,
        windows=windows,
        rows=keys * windows * rows_per_key,
        state_cells=0 if core is None else core.state_cells,
        baseline_mb=round(baseline, 1),
        rss_mb=round(_status_mb("VmRSS"), 1),
        peak_mb=round(_status_mb("VmHWM"), 1),
    )


def measure(
    spec: PipelineSpec, role: str, keys: int, windows: int, *, rows_per_key: int, batch: int
) -> MemoryFigure:
    """One figure, measured in a fresh process."""
    spec = _uncapped(spec, keys * windows * (rows_per_key + 1))
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_measure, ((spec, role, keys, windows, rows_per_key, batch),))


def _uncapped(spec: PipelineSpec, cells: int) -> PipelineSpec:
    """``spec`` with a state cap above what the figure holds (the cap is not measured here)."""
    return replace(spec, max_state_cells=max(spec.state_cap(None), 2 * cells))


def format_table(figures: list[MemoryFigure], load: tuple[float, float, float]) -> str:
    """The figures as a Markdown table, with the machine's load."""
    lines = [
        "| role | keys | open windows | rows | state cells | baseline MB | RSS MB | peak MB "
        "| bytes per key per open window |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {f.role} | {f.keys:,} | {f.windows} | {f.rows:,} | {f.state_cells:,} "
        f"| {f.baseline_mb:.0f} | {f.rss_mb:.0f} | {f.peak_mb:.0f} "
        f"| {f.bytes_per_key_window:,.0f} |"
        for f in figures
    )
    lines.append(
        f"load average (1/5/15 min) at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )
    return "\n".join(lines)
