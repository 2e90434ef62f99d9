"""The baseline's gateways: open-loop generation, one HTTP sender per gateway.

Each gateway's sensors are the simulator's (``SensorField`` with the same ids, rates and
seeds as ``shoal simulate``), cut into batches by the gateway library's ``Batcher`` (a full
batch of ``batch_size`` rows, or a partial one after ``max_delay_ms``), exactly as shoal's
simulated gateways do. A generator thread ticks every ``tick_ms`` and queues sealed batches;
it never waits for the server, so a slow server shows up as a growing queue at the
gateways, as in the research. One sender thread per gateway encodes each batch as JSON rows,
POSTs it over a keep-alive connection and waits for the reply before sending the next.

Per batch it records t_ex (the server's ``X-Processing-Ms``), t_rr (request sent → reply
read) and the wait in the gateway's queue (sealed → request sent).

Run as ``python -m shoal.loadtest.baseline.driver CONFIG.json OUT.json``: prints one JSON
progress line a second on stdout (``{"started": true}`` first) and writes a ``DriverReport``.
"""

from __future__ import annotations

import http.client
import queue
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import orjson

from shoal.gateway._batcher import Batcher
from shoal.loadtest.baseline.app import PROCESSING_HEADER, ROUTE
from shoal.loadtest.data import SensorField
from shoal.schemas import Measurements

KINDS: Final = (
    ("temperature", "degC"),
    ("humidity", "%"),
    ("pressure", "hPa"),
    ("vibration", "mm/s"),
)
"""Sensor types and units, assigned round robin: the research's sensor model."""

_START_MS: Final = 1_700_000_000_000


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """What the driver sends where.

    Attributes:
        urls: the servers (``http://127.0.0.1:PORT``); gateway ``i`` uses ``urls[i % n]``.
        gateways: gateways, one sender each.
        sensors: sensors per gateway.
        rate_hz: measurements per second per sensor.
        batch_size: rows per full batch.
        duration_s: how long to generate.
        warmup_s: the first seconds of generation, left out of the figures.
        drain_s: after generation, how long senders may still work off their queues.
        max_delay_ms: seal a partial batch after this long (as shoal's gateways do).
        tick_ms: generator period.
        seed: gateway ``i``'s sensors use ``seed + i`` (as ``shoal simulate``).
        gateway_prefix: gateway ids are ``<prefix>000``, ... (as ``shoal simulate``).
        attributes: send name, type and unit with every row (the research's rows).
        timeout_s: HTTP timeout per request.
    """

    urls: tuple[str, ...]
    gateways: int = 1
    sensors: int = 1000
    rate_hz: float = 25.0
    batch_size: int = 16_000
    duration_s: float = 20.0
    warmup_s: float = 3.0
    drain_s: float = 10.0
    max_delay_ms: int = 1_000
    tick_ms: int = 50
    seed: int = 0
    gateway_prefix: str = "sim-gw"
    attributes: bool = True
    timeout_s: float = 120.0

    @property
    def offered_rate(self) -> float:
        """Measurements per second offered, in all."""
        return self.gateways * self.sensors * self.rate_hz

    @classmethod
    def from_json(cls, data: bytes) -> DriverConfig:
        """Read a config written by ``to_json``."""
        fields = orjson.loads(data)
        fields["urls"] = tuple(fields["urls"])
        return cls(**fields)

    def to_json(self) -> bytes:
        """As JSON, for the driver's command line."""
        return orjson.dumps(asdict(self))


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch, times in seconds since generation started (the driver's monotonic clock)."""

    gateway: int
    seq: int
    rows: int
    sealed_s: float
    sent_s: float
    replied_s: float
    t_ex_ms: float | None
    request_bytes: int
    response_bytes: int
    status: int

    @property
    def t_rr_ms(self) -> float:
        """Request sent → reply read."""
        return (self.replied_s - self.sent_s) * 1000.0

    @property
    def sealed_to_reply_ms(self) -> float:
        """Sealed at the gateway → reply read (includes the wait in the gateway's queue)."""
        return (self.replied_s - self.sealed_s) * 1000.0


@dataclass
class DriverReport:
    """What the driver did (written as JSON)."""

    config: dict[str, Any]
    generated_rows: int
    generation_s: float
    batches: list[BatchRecord]
    unsent_batches: int
    unsent_rows: int
    queued_rows_at_end: int
    cpu_s: float
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        """As JSON (batch records as lists of their fields, to keep the file small)."""
        data = asdict(self)
        data["batch_fields"] = list(BatchRecord.__dataclass_fields__)
        data["batches"] = [list(asdict(b).values()) for b in self.batches]
        return orjson.dumps(data)

    @classmethod
    def from_json(cls, raw: bytes) -> DriverReport:
        """Read what ``to_json`` wrote."""
        data = orjson.loads(raw)
        names = data.pop("batch_fields")
        data["batches"] = [BatchRecord(**dict(zip(names, b, strict=True))) for b in data["batches"]]
        return cls(**data)


class RowEncoder:
    """The research's JSON rows for one gateway's sensors (per-sensor parts made once)."""

    def __init__(self, gateway_id: str, ids: tuple[str, ...], *, attributes: bool) -> None:
        self.gateway_id = gateway_id
        self.bases: list[dict[str, str]] = []
        for i, sensor in enumerate(ids):
            kind, unit = KINDS[i % len(KINDS)]
            base = {"sensor_id": sensor}
            if attributes:
                base.update(name=f"{kind}-{i:04d}", type=kind, unit=unit)
            self.bases.append(base)

    def encode(self, block: Measurements, seq: int, sent_at_ms: int) -> bytes:
        """One batch: envelope fields and ``measurements``, a list of row objects."""
        bases = self.bases
        rows = [
            {**bases[code], "value": value, "ts": ts}
            for code, value, ts in zip(
                block.sensor_id.codes.tolist(), block.value.tolist(), block.ts.tolist(), strict=True
            )
        ]
        return orjson.dumps(
            {"gateway_id": self.gateway_id, "seq": seq, "sent_at": sent_at_ms, "measurements": rows}
        )


_Job = tuple[int, float, Measurements]  # seq, sealed (monotonic s), rows


class _Sender(threading.Thread):
    """One gateway's sender: POST each queued batch, wait for the reply, record it."""

    def __init__(
        self, index: int, url: str, encoder: RowEncoder, config: DriverConfig, t0: float
    ) -> None:
        super().__init__(name=f"sender-{index}", daemon=True)
        self.index = index
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.encoder = encoder
        self.config = config
        self.t0 = t0
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.records: list[BatchRecord] = []
        self.errors: list[str] = []
        self.queued_rows = 0
        self.deadline = float("inf")
        self._lock = threading.Lock()

    def submit(self, job: _Job) -> None:
        with self._lock:
            self.queued_rows += len(job[2])
        self.jobs.put(job)

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.config.timeout_s)
        try:
            while (job := self.jobs.get()) is not None:
                seq, sealed, block = job
                if time.monotonic() < self.deadline:
                    conn = self._post(conn, seq, sealed, block)
                with self._lock:
                    self.queued_rows -= len(block)
        finally:
            conn.close()

    def _post(
        self, conn: http.client.HTTPConnection, seq: int, sealed: float, block: Measurements
    ) -> http.client.HTTPConnection:
        body = self.encoder.encode(block, seq, int(time.time() * 1000))
        sent = time.monotonic()
        try:
            conn.request("POST", ROUTE, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            reply = response.read()
            status, header = response.status, response.getheader(PROCESSING_HEADER)
        except (OSError, http.client.HTTPException) as exc:
            self.errors.append(f"gateway {self.index} seq {seq}: {exc!r}")
            conn.close()
            return http.client.HTTPConnection(self.host, self.port, timeout=self.config.timeout_s)
        replied = time.monotonic()
        self.records.append(
            BatchRecord(
                gateway=self.index,
                seq=seq,
                rows=len(block),
                sealed_s=sealed - self.t0,
                sent_s=sent - self.t0,
                replied_s=replied - self.t0,
                t_ex_ms=float(header) if header else None,
                request_bytes=len(body),
                response_bytes=len(reply),
                status=status,
            )
        )
        return conn


def run(config: DriverConfig, progress: Any = None) -> DriverReport:
    """Generate for ``duration_s``, let senders drain for up to ``drain_s``; report."""
    cpu0 = _cpu_s()
    t0 = time.monotonic()
    ids = [f"{config.gateway_prefix}{i:03d}" for i in range(config.gateways)]
    fields = [
        SensorField(gid, config.sensors, config.rate_hz, _START_MS, seed=config.seed + i)
        for i, gid in enumerate(ids)
    ]
    senders = [
        _Sender(
            i,
            config.urls[i % len(config.urls)],
            RowEncoder(gid, fields[i].ids, attributes=config.attributes),
            config,
            t0,
        )
        for i, gid in enumerate(ids)
    ]
    batchers = [Batcher(config.batch_size, config.max_delay_ms) for _ in ids]
    seqs = [0] * len(ids)
    for sender in senders:
        sender.start()
    if progress is not None:
        progress({"started": True})

    def seal(i: int, batches: list[tuple[Measurements, float]], now: float) -> None:
        for block, _ in batches:
            seqs[i] += 1
            senders[i].submit((seqs[i], now, block))

    generated = 0
    tick_s = config.tick_ms / 1000.0
    next_tick = next_report = t0
    while True:
        now = time.monotonic()
        elapsed = min(now - t0, config.duration_s)
        until_ms = _START_MS + int(elapsed * 1000)
        for i, (sensor_field, batcher) in enumerate(zip(fields, batchers, strict=True)):
            block = sensor_field.take(until_ms)
            generated += len(block)
            batcher.add(block, now)
            seal(i, batcher.take_due(now), now)
        if elapsed >= config.duration_s:
            break
        if progress is not None and now >= next_report:
            next_report += 1.0
            progress(_progress(senders, elapsed, generated))
        next_tick += tick_s
        time.sleep(max(0.0, next_tick - time.monotonic()))
    generation_s = time.monotonic() - t0
    queued_at_end = sum(s.queued_rows for s in senders)
    for i, batcher in enumerate(batchers):
        seal(i, batcher.take_all(), time.monotonic())
    deadline = time.monotonic() + config.drain_s
    for sender in senders:
        sender.deadline = deadline
        sender.jobs.put(None)
    for sender in senders:
        sender.join(max(0.0, deadline - time.monotonic()) + config.timeout_s)
    records = sorted((r for s in senders for r in s.records), key=lambda r: r.sealed_s)
    sent_rows = sum(r.rows for r in records)
    sent_batches = len(records)
    return DriverReport(
        config=asdict(config),
        generated_rows=generated,
        generation_s=round(generation_s, 3),
        batches=records,
        unsent_batches=sum(seqs) - sent_batches,
        unsent_rows=generated - sent_rows,
        queued_rows_at_end=queued_at_end,
        cpu_s=round(_cpu_s() - cpu0, 3),
        errors=[e for s in senders for e in s.errors][:20],
    )


def _progress(senders: list[_Sender], elapsed: float, generated: int) -> dict[str, Any]:
    return {
        "elapsed_s": round(elapsed, 1),
        "generated": generated,
        "replied_rows": sum(r.rows for s in senders for r in s.records),
        "queued_rows": sum(s.queued_rows for s in senders),
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    """``driver CONFIG.json OUT.json``: run and write the report."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m shoal.loadtest.baseline.driver CONFIG.json OUT.json\n")
        return 2
    config = DriverConfig.from_json(Path(args[0]).read_bytes())

    def progress(line: dict[str, Any]) -> None:
        sys.stdout.write(orjson.dumps(line).decode() + "\n")
        sys.stdout.flush()

    report = run(config, progress)
    Path(args[1]).write_bytes(report.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
