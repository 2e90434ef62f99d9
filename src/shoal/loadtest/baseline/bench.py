"""One baseline run: Waitress server process(es) + the driver, measured like a shoal run.

``run_baseline`` starts ``instances`` servers (one Waitress thread each by default), lets the
driver offer a fixed rate for ``warmup_s + duration_s``, and returns a record whose names
follow ``shoal bench pipeline``'s: offered and achieved measurements per second, t_ex and
t_rr per batch (with CDF points), CPU and peak RSS per process over the measured window, and
what was not processed (still queued at the gateways, or failed).

Composition root: imported by ``shoal bench matrix`` and tests only.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

import orjson

from shoal._processes import ChildProcess
from shoal.loadtest.baseline.driver import BatchRecord, DriverConfig, DriverReport
from shoal.loadtest.bench_pipeline import machine
from shoal.runtime.latency import LatencyHistogram
from shoal.runtime.local import ResourceSampler

SUSTAIN_FRACTION: Final = 0.98
MAX_QUEUED_SECONDS: Final = 2.0
START_TIMEOUT_S: Final = 60.0
SCENARIO_GATEWAYS: Final = {"A": 1, "B": 10}


@dataclass(frozen=True, slots=True)
class BaselineBenchConfig:
    """One baseline run.

    Attributes:
        scenario: ``A`` (1 gateway x 1,000 sensors) or ``B`` (10 x 1,000).
        rate: measurements per second per sensor.
        batch: rows per full batch.
        duration_s: measured seconds (after ``warmup_s``).
        warmup_s: seconds of load before measuring.
        instances: server processes (gateways are spread over them round robin).
        threads: Waitress threads per server (the research: 1).
        max_delay_ms: the gateways seal a partial batch after this long.
        attributes: rows carry name, type and unit (the research's rows).
    """

    scenario: str = "A"
    rate: float = 25.0
    batch: int = 16_000
    duration_s: float = 20.0
    warmup_s: float = 3.0
    instances: int = 1
    threads: int = 1
    max_delay_ms: int = 1_000
    attributes: bool = True

    @property
    def gateways(self) -> int:
        """Gateways in the scenario."""
        return SCENARIO_GATEWAYS[self.scenario.upper()]

    @property
    def offered(self) -> float:
        """Measurements per second offered."""
        return self.gateways * 1_000 * self.rate


def run_baseline(config: BaselineBenchConfig, progress: TextIO | None = None) -> dict[str, Any]:
    """Run once; returns the JSON record."""
    run_dir = Path(tempfile.mkdtemp(prefix="shoal-baseline-"))
    sampler = ResourceSampler()
    servers: list[ChildProcess] = []
    driver: ChildProcess | None = None
    try:
        urls = [
            _start_server(i, config, run_dir, servers, sampler) for i in range(config.instances)
        ]
        driver_config = DriverConfig(
            urls=tuple(urls),
            gateways=config.gateways,
            rate_hz=config.rate,
            batch_size=config.batch,
            duration_s=config.warmup_s + config.duration_s,
            warmup_s=config.warmup_s,
            max_delay_ms=config.max_delay_ms,
            attributes=config.attributes,
        )
        (run_dir / "driver.json").write_bytes(driver_config.to_json())
        driver = ChildProcess(
            "driver",
            [
                sys.executable,
                "-m",
                "shoal.loadtest.baseline.driver",
                str(run_dir / "driver.json"),
                str(run_dir / "report.json"),
            ],
            run_dir / "driver.log",
        )
        driver.start()
        sampler.watch("driver", driver.pid)
        _wait_for_line(driver, "started")
        cpu = _measure_window(config, driver, sampler, progress)
        if driver.wait(config.duration_s + 600.0) is None:
            raise RuntimeError(f"the baseline driver did not finish; log: {driver.log_path}")
        report = DriverReport.from_json((run_dir / "report.json").read_bytes())
        return _record(config, report, cpu, sampler)
    finally:
        if driver is not None:
            driver.stop()
        for server in servers:
            server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _start_server(
    index: int,
    config: BaselineBenchConfig,
    run_dir: Path,
    servers: list[ChildProcess],
    sampler: ResourceSampler,
) -> str:
    server = ChildProcess(
        f"baseline-{index}",
        [
            sys.executable,
            "-m",
            "shoal.loadtest.baseline.server",
            "--port",
            "0",
            "--threads",
            str(config.threads),
        ],
        run_dir / f"server-{index}.log",
    )
    server.start()
    servers.append(server)
    sampler.watch(server.name, server.pid)
    line = _wait_for_line(server, "port")
    return f"http://127.0.0.1:{int(line['port'])}"


def _wait_for_line(child: ChildProcess, key: str) -> dict[str, Any]:
    """The first JSON line of ``child``'s output that has ``key``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in _json_lines(child.log_path):
            if key in line:
                return line
        if not child.alive():
            break
        time.sleep(0.05)
    raise RuntimeError(
        f"{child.name} did not report {key!r} (log {child.log_path}):\n{child.log_tail()}"
    )


def _json_lines(path: Path) -> Iterable[dict[str, Any]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(value, dict):
                yield value


def _measure_window(
    config: BaselineBenchConfig,
    driver: ChildProcess,
    sampler: ResourceSampler,
    progress: TextIO | None,
) -> dict[str, float]:
    """CPU seconds per process over the measured window (sampling peak RSS meanwhile)."""
    started = time.monotonic()
    window_start = started + config.warmup_s
    window_end = window_start + config.duration_s
    first: dict[str, float] | None = None
    while (now := time.monotonic()) < window_end:
        sampler.sample()
        if first is None and now >= window_start:
            first = sampler.cpu_seconds()
        if progress is not None and first is not None:
            last = list(_json_lines(driver.log_path))[-1:]
            if last:
                line = last[0]
                print(
                    f"  [{now - window_start:5.1f} s] replied {line.get('replied_rows', 0):>12,} "
                    f"meas  queued at gateways {line.get('queued_rows', 0):>10,} meas",
                    file=progress,
                    flush=True,
                )
        time.sleep(min(1.0, max(0.05, (window_start if first is None else window_end) - now)))
    last_cpu = sampler.cpu_seconds()
    start_cpu = first or {}
    return {name: last_cpu[name] - start_cpu[name] for name in last_cpu if name in start_cpu}


def _summary(values: Iterable[float]) -> dict[str, Any] | None:
    histogram = LatencyHistogram()
    for value in values:
        histogram.add(value)
    return histogram.summary()


def _record(
    config: BaselineBenchConfig,
    report: DriverReport,
    cpu: dict[str, float],
    sampler: ResourceSampler,
) -> dict[str, Any]:
    start, end = config.warmup_s, config.warmup_s + config.duration_s
    ok = [b for b in report.batches if b.status == 200]
    measured = [b for b in ok if start <= b.sealed_s < end]
    replied_in_window = sum(b.rows for b in ok if start <= b.replied_s < end)
    achieved = replied_in_window / config.duration_s
    processed = sum(b.rows for b in ok)
    generated_rate = report.generated_rows / max(report.generation_s, 1e-9)
    failed = len(report.batches) - len(ok)
    # A window counts whole batches: allow one batch per gateway either way.
    granularity = config.gateways * config.batch / config.duration_s
    sustained = (
        achieved >= SUSTAIN_FRACTION * config.offered - granularity
        and generated_rate >= SUSTAIN_FRACTION * config.offered
        and report.queued_rows_at_end <= MAX_QUEUED_SECONDS * config.offered
        and failed == 0
        and not report.errors
    )
    peak = {c["name"]: c["rss_mb"] for c in sampler.report()}
    return {
        "system": "baseline",
        "scenario": config.scenario,
        "rate_per_sensor": config.rate,
        "batch": config.batch,
        "encoding": "json-rows over HTTP",
        "instances": config.instances,
        "threads": config.threads,
        "attributes": config.attributes,
        "duration_s": config.duration_s,
        "offered_meas_per_s": round(config.offered, 1),
        "driver_meas_per_s": round(generated_rate, 1),
        "achieved_meas_per_s": round(achieved, 1),
        "generated_measurements": report.generated_rows,
        "processed_measurements": processed,
        "unprocessed_measurements": report.generated_rows - processed,
        "queued_at_end_measurements": report.queued_rows_at_end,
        "failed_batches": failed,
        "errors": report.errors,
        "sustained": sustained,
        "batches": len(measured),
        "mean_batch_rows": round(sum(b.rows for b in measured) / max(len(measured), 1), 1),
        "t_ex_ms": _summary(b.t_ex_ms for b in measured if b.t_ex_ms is not None),
        "t_rr_ms": _summary(b.t_rr_ms for b in measured),
        "sealed_to_reply_ms": _summary(b.sealed_to_reply_ms for b in measured),
        "bytes_per_meas": _per_meas(measured, "request_bytes"),
        "reply_bytes_per_meas": _per_meas(measured, "response_bytes"),
        "window_components": [
            {
                "name": name,
                "cpu_seconds": round(seconds, 3),
                "cpu_percent": round(100.0 * seconds / config.duration_s, 1),
                "rss_mb": peak.get(name),
            }
            for name, seconds in cpu.items()
        ],
        "driver_cpu_s": report.cpu_s,
        "machine": machine(),
    }


def _per_meas(batches: list[BatchRecord], name: str) -> float | None:
    rows = sum(b.rows for b in batches)
    return round(sum(getattr(b, name) for b in batches) / rows, 2) if rows else None
