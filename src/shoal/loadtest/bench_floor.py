"""The latency floor of one batch on this machine: what no design with a broker goes below.

``shoal bench floor`` measures, at the pace of the research's scenario A (one 4,000-row
batch every 160 ms, so every process sleeps between batches), the parts every MQTT pipeline
pays for a batch, each in isolation:

* **wakeup**: a process woken by a write to a socket from another process (a socketpair):
  the kernel and the virtual machine's floor, no Python library in between but the socket;
* **hop**: one QoS 1 message of a batch's size through the embedded Mosquitto, from one
  shoal MQTT session to another, each in its own process (``shoal.broker.AsyncSession``,
  aiomqtt over paho): the floor of one broker hop;
* **handle**: what a worker does with a batch (decode the binary columnar payload, compute the
  partials, encode them), back to back (warm) and after sleeping the batch period (idle,
  what a worker really sees at scenario A).

The sum hop + handle (idle) is the least any design that passes batches through a broker can
take from a gateway's publish to the batch's aggregates, before applying them anywhere. The
benchmark report (docs/benchmarks.md) sets it against the research's request/reply time.
Times cross processes by the wall clock (``time.time_ns``): one machine, one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.settings import BrokerSettings
from shoal.errors import ConfigError, UsageError
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.schemas import Encoding, decode_batch, encode_batch

from .data import synthetic_block

DEFAULT_PERIOD_MS: Final = 160.0
"""Scenario A: 1,000 sensors x 25/s in batches of 4,000 is one batch every 160 ms."""
DEFAULT_SAMPLES: Final = 200
DEFAULT_ROWS: Final = 4_000
WARM_UP: Final = 20
TOPIC: Final = "bench/floor"


@dataclass(frozen=True, slots=True)
class Spread:
    """Percentiles of one measured time, in milliseconds."""

    min: float
    p50: float
    p95: float
    p99: float
    max: float
    n: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Spread:
        """Percentiles of the samples (linear interpolation)."""
        if not samples_ms:
            raise UsageError("no samples")
        values = np.asarray(samples_ms, dtype=np.float64)
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        return cls(
            round(float(values.min()), 3),
            round(float(p50), 3),
            round(float(p95), 3),
            round(float(p99), 3),
            round(float(values.max()), 3),
            len(samples_ms),
        )


@dataclass(frozen=True, slots=True)
class Floor:
    """The floors measured in one run."""

    period_ms: float
    rows: int
    payload_bytes: int
    wakeup: Spread
    hop: Spread
    handle_warm: Spread
    handle_idle: Spread
    broker: str = "mosquitto"
    """The broker of the hop (``EmbeddedBroker.broker``)."""

    @property
    def one_hop_path_ms(self) -> dict[str, float]:
        """One hop plus an idle handle: the least a brokered batch takes.

        ``p50``: the sum of the parts' medians. ``p99_at_least``: the hop's p99 plus the
        fastest idle handle, a lower bound of the path's p99 (every sample of the path is
        a hop plus a handle no faster than that). ``p99_sum``: the sum of the parts' p99s.
        """
        return {
            "p50": round(self.hop.p50 + self.handle_idle.p50, 3),
            "p99_at_least": round(self.hop.p99 + self.handle_idle.min, 3),
            "p99_sum": round(self.hop.p99 + self.handle_idle.p99, 3),
        }

    def as_record(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**asdict(self), "one_hop_path_ms": self.one_hop_path_ms}


def run(
    spec: PipelineSpec,
    *,
    period_ms: float = DEFAULT_PERIOD_MS,
    samples: int = DEFAULT_SAMPLES,
    rows: int = DEFAULT_ROWS,
    progress: Callable[[str], None] = lambda _: None,
) -> Floor:
    """Measure the three floors (about ``3 x samples x period`` seconds)."""
    if samples < 1 or period_ms <= 0 or rows < 1:
        raise ConfigError("samples, period and rows must be positive")
    payload = encode_batch(
        synthetic_block(rows),
        gateway_id="gw00",
        seq=0,
        sent_at_ms=int(time.time() * 1000),
        encoding=Encoding.BINARY_COLUMNAR,
    )
    progress(f"wakeup: {samples} socket writes, one every {period_ms:g} ms")
    wakeup = Spread.of(_wakeups(period_ms, samples, len(payload)))
    with EmbeddedBroker() as broker:
        progress(f"hop: {samples} messages of {len(payload):,} bytes through {broker.broker}")
        hop = Spread.of(_hops(broker.settings, period_ms, samples, len(payload)))
    progress(f"handle: {samples} batches of {rows:,} rows, warm and after {period_ms:g} ms idle")
    warm, idle = _handles(spec, payload, period_ms, samples)
    return Floor(
        period_ms, rows, len(payload), wakeup, hop, Spread.of(warm), Spread.of(idle), broker.broker
    )


# -- wakeup and hop: a receiving child process -------------------------------------------


@contextlib.contextmanager
def _receiver(target: Callable[..., None], *args: object) -> Iterator[Connection]:
    """Run ``target(*args, conn)`` in a fresh interpreter; yield our end of ``conn``."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    child.start()
    try:
        yield ours
    finally:
        child.join(timeout=10)


def _received(conn: Connection, what: str) -> object:
    if not conn.poll(30):
        raise RuntimeError(f"the receiving process did not send {what}")
    return conn.recv()


def _delays(samples: object) -> list[float]:
    """The receiver's delays (ms) without the warm-up."""
    assert isinstance(samples, list)
    return [float(ms) for ms in samples[WARM_UP:]]


def _wakeups(period_ms: float, samples: int, size: int) -> list[float]:
    with _receiver(_wakeup_receiver, samples + WARM_UP) as conn:
        padding = bytes(size)
        for _ in range(samples + WARM_UP):
            time.sleep(period_ms / 1000)
            conn.send_bytes(time.time_ns().to_bytes(8, "big") + padding)
        return _delays(_received(conn, "its delays"))


def _wakeup_receiver(count: int, conn: Connection) -> None:
    out = []
    for _ in range(count):
        data = conn.recv_bytes()
        out.append((time.time_ns() - int.from_bytes(data[:8], "big")) / 1e6)
    conn.send(out)


def _hops(settings: BrokerSettings, period_ms: float, samples: int, size: int) -> list[float]:
    with _receiver(_hop_receiver, settings, samples + WARM_UP) as conn:
        if _received(conn, "its subscription") != "subscribed":
            raise RuntimeError("the receiving session did not subscribe")
        asyncio.run(_hop_sender(settings, period_ms, samples + WARM_UP, size))
        return _delays(_received(conn, "its delays"))


async def _hop_sender(settings: BrokerSettings, period_ms: float, count: int, size: int) -> None:
    padding = bytes(size)
    async with AsyncSession(settings, "shoal-floor-sender") as session:
        for _ in range(count):
            await asyncio.sleep(period_ms / 1000)
            await session.publish_started(TOPIC, time.time_ns().to_bytes(8, "big") + padding)


def _hop_receiver(settings: BrokerSettings, count: int, conn: Connection) -> None:
    conn.send(asyncio.run(_receive_hops(settings, conn, count)))


async def _receive_hops(settings: BrokerSettings, conn: Connection, count: int) -> list[float]:
    out: list[float] = []
    async with AsyncSession(settings, "shoal-floor-receiver") as session:
        await session.subscribe([TOPIC], qos=1)
        conn.send("subscribed")
        async for message in session.messages():
            out.append((time.time_ns() - int.from_bytes(message.payload[:8], "big")) / 1e6)
            if len(out) == count:
                break
    return out


# -- handle --------------------------------------------------------------------------------


def _handles(
    spec: PipelineSpec, payload: bytes, period_ms: float, samples: int
) -> tuple[list[float], list[float]]:
    builder = PartialBuilder(spec, "floor")
    content_type = Encoding.BINARY_COLUMNAR.content_type

    def handle() -> float:
        started = time.perf_counter()
        now = int(time.time() * 1000)
        batch = decode_batch(payload, content_type=content_type, limits=spec.limits, now_ms=now)
        info = BatchInfo("gw00", 0, "s", batch.rows, None, None, now, now, "floor")
        for partial in builder.build_batch(batch, info, now):
            partial.encode()
        return (time.perf_counter() - started) * 1000.0

    for _ in range(WARM_UP):
        handle()
    warm = [handle() for _ in range(samples)]
    idle = []
    for _ in range(samples):
        time.sleep(period_ms / 1000)
        idle.append(handle())
    return warm, idle


def format_report(floor: Floor) -> str:
    """The table ``shoal bench floor`` prints."""
    lines = [
        f"one batch of {floor.rows:,} rows ({floor.payload_bytes:,} bytes, binary columnar) "
        f"every {floor.period_ms:g} ms",
        f"  {'':<40}{'min':>8}{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}   ms",
    ]
    rows = [
        ("wakeup (socketpair, 2 processes)", floor.wakeup),
        (f"hop (session -> {floor.broker} -> session)", floor.hop),
        ("handle, warm (back to back)", floor.handle_warm),
        ("handle, idle (after the period)", floor.handle_idle),
    ]
    for name, spread in rows:
        lines.append(
            f"  {name:<40}{spread.min:>8.2f}{spread.p50:>8.2f}{spread.p95:>8.2f}"
            f"{spread.p99:>8.2f}{spread.max:>8.2f}"
        )
    path = floor.one_hop_path_ms
    lines.append(
        f"  least brokered path (one hop + idle handle): p50 {path['p50']:.2f} ms; p99 at "
        f"least {path['p99_at_least']:.2f} ms (hop p99 + fastest handle), "
        f"{path['p99_sum']:.2f} ms as the sum of p99s"
    )
    return "\n".join(lines)
