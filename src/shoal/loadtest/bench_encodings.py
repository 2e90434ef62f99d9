"""The encoding benchmark: wire size, encode and decode throughput of every encoding.

For each encoding and batch size it encodes one synthetic block (the producer's columnar
``Measurements``, as the gateway library holds it) and decodes the payload to the worker's
DataFrame, many times in this one process, and reports medians. Imports only the wire
format and the synthetic data; printing and files are the CLI's business.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import polars as pl
import psutil

from shoal.errors import ConfigError
from shoal.loadtest.data import synthetic_block
from shoal.schemas import Encoding, Measurements, decode_batch, encode_batch

DEFAULT_SIZES: Final = (4_000, 16_000, 64_000)
DEFAULT_REPEATS: Final = 7
SENSORS: Final = 1_000
RESOLUTION: Final = 0.001
MIN_SAMPLE_S: Final = 0.02
"""A timed sample repeats the call until it lasts this long, so tiny batches still time well."""

_GATEWAY: Final = "bench-gw"
_SENT_AT_MS: Final = 1_700_000_000_000


@dataclass(frozen=True, slots=True)
class Codec:
    """One way to put a batch on the wire: an encoding, with or without zstd."""

    encoding: Encoding
    zstd: bool = False

    @property
    def label(self) -> str:
        """``binary-columnar+zstd`` style name for tables."""
        return f"{self.encoding.value}+zstd" if self.zstd else self.encoding.value


CODECS: Final = (
    Codec(Encoding.JSON_ROWS),
    Codec(Encoding.MSGPACK_ROWS),
    Codec(Encoding.MSGPACK_COLUMNAR),
    Codec(Encoding.BINARY_COLUMNAR),
    Codec(Encoding.BINARY_COLUMNAR, zstd=True),
)
"""Every codec, the baseline (JSON rows, what the research's gateways send) first."""


@dataclass(frozen=True, slots=True)
class EncodingResult:
    """The figures for one codec at one batch size (the records ``--json`` writes).

    Attributes:
        encoding: the encoding's wire name.
        zstd: whether the body was zstd-compressed (binary columnar only).
        codec: ``encoding`` plus ``+zstd`` when compressed: unique per row of the table.
        batch_size: measurements per batch.
        payload_bytes: size of one encoded batch.
        bytes_per_measurement: ``payload_bytes / batch_size``.
        encode_meas_per_s: measurements encoded per second (median of ``repeats`` samples).
        decode_meas_per_s: measurements decoded to a DataFrame per second (median).
        repeats: timed samples per figure.
    """

    encoding: str
    zstd: bool
    codec: str
    batch_size: int
    payload_bytes: int
    bytes_per_measurement: float
    encode_meas_per_s: float
    decode_meas_per_s: float
    repeats: int

    def as_record(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Machine:
    """Facts about where the figures were measured."""

    cpu: str
    cores_logical: int
    cores_physical: int | None
    python: str
    polars: str
    polars_threads: int
    numpy: str
    platform: str
    load_1m: float
    """Load average when measured: other work on the machine makes the figures noisy."""

    def as_record(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def machine() -> Machine:
    """CPU model, core counts and library versions of this process."""
    return Machine(
        cpu=_cpu_model(),
        cores_logical=os.cpu_count() or 1,
        cores_physical=psutil.cpu_count(logical=False),
        python=platform.python_version(),
        polars=metadata.version("polars"),
        polars_threads=pl.thread_pool_size(),
        numpy=metadata.version("numpy"),
        platform=platform.platform(terse=True),
        load_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
    )


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _median_seconds(
    call: Callable[[], object], repeats: int, timer: Callable[[], float] = time.perf_counter
) -> float:
    """Median time of ``call`` over ``repeats`` samples (wall time, or ``timer``'s).

    One untimed warm-up call pays first-call costs; one timed call then sets how many calls
    a sample makes (enough to last ``MIN_SAMPLE_S``).
    """
    call()
    started = timer()
    call()
    single = timer() - started
    loops = max(1, math.ceil(MIN_SAMPLE_S / single)) if single > 0 else 1
    samples = []
    # The collector would charge one call for garbage made by another; timeit does the same.
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            started = timer()
            for _ in range(loops):
                call()
            samples.append((timer() - started) / loops)
    finally:
        gc.enable()
    return statistics.median(samples)


def encode_with(block: Measurements, codec: Codec) -> bytes:
    """``block`` as one batch payload with ``codec`` (a fixed benchmark envelope)."""
    return encode_batch(
        block,
        gateway_id=_GATEWAY,
        seq=1,
        sent_at_ms=_SENT_AT_MS,
        encoding=codec.encoding,
        zstd=codec.zstd,
    )


def measure(block: Measurements, codec: Codec, repeats: int) -> EncodingResult:
    """Encode and decode ``block`` with ``codec``; sizes and median throughputs."""
    n = len(block)

    def encode() -> bytes:
        return encode_with(block, codec)

    payload = encode()
    decoded = decode_batch(payload, content_type=codec.encoding.content_type)
    if decoded.frame.height != n:
        raise AssertionError(f"{codec.label} decoded {decoded.frame.height} of {n} rows")
    encode_s = _median_seconds(encode, repeats)
    decode_s = _median_seconds(
        lambda: decode_batch(payload, content_type=codec.encoding.content_type), repeats
    )
    return EncodingResult(
        encoding=codec.encoding.value,
        zstd=codec.zstd,
        codec=codec.label,
        batch_size=n,
        payload_bytes=len(payload),
        bytes_per_measurement=len(payload) / n,
        encode_meas_per_s=n / encode_s,
        decode_meas_per_s=n / decode_s,
        repeats=repeats,
    )


def run(
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    *,
    codecs: Sequence[Codec] = CODECS,
    progress: Callable[[EncodingResult], None] | None = None,
) -> list[EncodingResult]:
    """Every codec at every batch size, on ``SENSORS`` synthetic sensors.

    Raises:
        ConfigError: a size or ``repeats`` below 1.
    """
    if repeats < 1 or any(size < 1 for size in sizes):
        raise ConfigError("batch sizes and repeats must be at least 1")
    results = []
    for size in sizes:
        block = synthetic_block(size, sensors=SENSORS)
        for codec in codecs:
            result = measure(block, codec, repeats)
            results.append(result)
            if progress is not None:
                progress(result)
    return results


def ratio(result: EncodingResult, baseline: EncodingResult) -> dict[str, float]:
    """``result`` relative to ``baseline``: size (lower is better) and speeds (higher is)."""
    return {
        "bytes": result.bytes_per_measurement / baseline.bytes_per_measurement,
        "encode": result.encode_meas_per_s / baseline.encode_meas_per_s,
        "decode": result.decode_meas_per_s / baseline.decode_meas_per_s,
    }


def format_table(results: Sequence[EncodingResult]) -> str:
    """The results as a text table, with ratios against JSON rows at the same batch size."""
    baselines = {r.batch_size: r for r in results if r.codec == Encoding.JSON_ROWS.value}
    header = (
        f"{'encoding':<22} {'batch':>6} {'B/meas':>7} {'x json':>7} "
        f"{'encode meas/s':>14} {'x json':>7} {'decode meas/s':>14} {'x json':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        base = baselines.get(r.batch_size)
        x = ratio(r, base) if base is not None else None
        lines.append(
            f"{r.codec:<22} {r.batch_size:>6} {r.bytes_per_measurement:>7.2f} "
            f"{_times(x, 'bytes')} {_rate(r.encode_meas_per_s):>14} {_times(x, 'encode')} "
            f"{_rate(r.decode_meas_per_s):>14} {_times(x, 'decode')}"
        )
    return "\n".join(lines)


def _times(x: dict[str, float] | None, key: str) -> str:
    return f"{x[key]:>6.2f}x" if x is not None else f"{'-':>7}"


def _rate(per_s: float) -> str:
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f} M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.1f} k"
    return f"{per_s:.0f}"


def describe(facts: Machine, repeats: int) -> str:
    """The header printed above the table: data, method, machine."""
    physical = f" ({facts.cores_physical} physical)" if facts.cores_physical else ""
    return "\n".join(
        [
            f"data:    shoal.loadtest.data.synthetic_block: {SENSORS:,} sensors, values at "
            f"{RESOLUTION} resolution, encoded from a columnar Measurements block",
            f"method:  median of {repeats} timed samples per figure, one process; decode = "
            "payload to a polars DataFrame with the full contract checks",
            f"machine: {facts.cpu}, {facts.cores_logical} cores{physical}; Python "
            f"{facts.python}, polars {facts.polars} ({facts.polars_threads} threads), numpy "
            f"{facts.numpy}; {facts.platform}; load average {facts.load_1m:.2f}",
        ]
    )
