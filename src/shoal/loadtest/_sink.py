"""The simulator's sink: a plain subscriber that counts (and optionally confirms) batches.

Runs in its own process (``python -m shoal.loadtest._sink``) so that its CPU is not charged
to the simulator. Protocol, one JSON object per line:

- stdin, first line: ``SinkConfig`` fields; then EOF (or the line ``stop``) ends the run;
- stdout: ``{"ready": true}`` once subscribed (SUBACK received), a ``SinkCounts`` object
  every half second, and a last one with ``"final": true``.

With ``confirm`` it publishes a retained ``Confirm`` (pipeline ``sink``, one partition) for
the highest contiguous seq of each gateway, standing in for a combiner so gateway spools
drain. It learns where a gateway's sequence starts from its retained status, as a combiner
does. Not a pipeline: rows are counted (deduplicated on gateway and seq), not aggregated.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import orjson

from shoal._futures import ignore_outcome
from shoal._spawn import spawn_tied
from shoal.broker import AsyncSession
from shoal.broker.session import Message, unique_client_id
from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import BrokerError, ShoalError
from shoal.schemas import decode_batch
from shoal.schemas.control import Confirm, GatewayStatus
from shoal.schemas.topics import Topics

PIPELINE = "sink"
"""The pipeline name the sink confirms as."""
_RECONNECT_S = 0.2
"""Pause between connection attempts while the broker is away."""


@dataclass(frozen=True, slots=True)
class SinkConfig:
    """What the sink subscribes to and whether it confirms."""

    host: str
    port: int
    topic_root: str
    stream: str
    confirm: bool
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_settings(
        cls, settings: BrokerSettings, topics: Topics, stream: str, *, confirm: bool
    ) -> SinkConfig:
        """The sink's view of a broker and stream."""
        tls = settings.tls
        return cls(
            host=settings.host,
            port=settings.port,
            topic_root=topics.root,
            stream=stream,
            confirm=confirm,
            username=settings.username,
            password=settings.password,
            tls_ca=str(tls.ca_file) if tls and tls.ca_file else None,
            tls_cert=str(tls.cert_file) if tls and tls.cert_file else None,
            tls_key=str(tls.key_file) if tls and tls.key_file else None,
        )

    def settings(self) -> BrokerSettings:
        """Back to ``BrokerSettings``."""
        tls = None
        if self.tls_ca or self.tls_cert or self.tls_key:
            tls = TlsSettings(
                ca_file=Path(self.tls_ca) if self.tls_ca else None,
                cert_file=Path(self.tls_cert) if self.tls_cert else None,
                key_file=Path(self.tls_key) if self.tls_key else None,
            )
        return BrokerSettings(
            host=self.host,
            port=self.port,
            username=self.username,
            password=self.password,
            tls=tls,
        )


@dataclass(slots=True)
class SinkCounts:
    """What the sink received so far (rows and batches deduplicated on gateway and seq)."""

    rows: int = 0
    batches: int = 0
    messages: int = 0
    bytes: int = 0
    duplicates: int = 0
    errors: int = 0
    gateways: int = 0
    final: bool = False


@dataclass(slots=True)
class _Gateway:
    seen: set[int] = field(default_factory=set)  # seqs received above ``contiguous``
    contiguous: int = -1
    confirmed: int = -1
    started: bool = False


class Sink:
    """Counts batches on ``ingest/<stream>/+``; confirms them if asked."""

    def __init__(self, config: SinkConfig) -> None:
        self.config = config
        self.topics = Topics(config.topic_root)
        self.counts = SinkCounts()
        self._gateways: dict[str, _Gateway] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> SinkCounts:
        """A copy of the counts."""
        with self._lock:
            return replace(self.counts)

    async def run(self, stop: asyncio.Event, ready: asyncio.Event) -> None:
        """Subscribe, count until ``stop``; connect and subscribe again if the broker restarts.

        What was published while the sink was away is re-sent by the gateways (they re-send
        every unconfirmed batch on reconnect) and deduplicated here.
        """
        while not stop.is_set():
            try:
                await self._run_once(stop, ready)
            except BrokerError:
                if not ready.is_set():
                    raise  # never subscribed: a wrong address or credentials, not a restart
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_RECONNECT_S):
                        await stop.wait()

    async def _run_once(self, stop: asyncio.Event, ready: asyncio.Event) -> None:
        session = AsyncSession(self.config.settings(), unique_client_id("sim-sink"))
        async with session:
            await session.subscribe(
                [
                    self.topics.ingest_filter(self.config.stream),
                    self.topics.gateway_status_all(),
                ]
            )
            ready.set()
            async for message in session.messages_until(stop):
                confirm = self._handle(message)
                if confirm is not None and self.config.confirm:
                    # Not awaited: confirmations are best effort, the gateway re-sends.
                    future = session.publish_started(
                        self.topics.confirm(confirm.gateway_id, PIPELINE, 0),
                        confirm.to_json(),
                        retain=True,
                    )
                    future.add_done_callback(ignore_outcome)

    def _handle(self, message: Message) -> Confirm | None:
        if self.topics.ingest_gateway(message.topic) is None:
            self._status(message)
            return None
        try:
            batch = decode_batch(message.payload, content_type=message.content_type)
        except ShoalError:
            with self._lock:
                self.counts.errors += 1
            return None
        env = batch.envelope
        with self._lock:
            counts = self.counts
            counts.messages += 1
            counts.bytes += len(message.payload)
            state = self._gateways.get(env.gateway_id)
            if state is None:
                state = self._gateways[env.gateway_id] = _Gateway()
                counts.gateways += 1
            state.started = True
            if env.seq <= state.contiguous or env.seq in state.seen:
                counts.duplicates += 1
                # A re-send: the gateway may have missed the confirm (a broker restart lost
                # it), so confirm again, as a combiner does.
                if state.contiguous < 0:
                    return None
                return Confirm(env.gateway_id, PIPELINE, 0, 1, state.contiguous, _now_ms())
            state.seen.add(env.seq)
            counts.rows += env.rows
            counts.batches += 1
            while state.contiguous + 1 in state.seen:
                state.contiguous += 1
                state.seen.discard(state.contiguous)
            if state.contiguous <= state.confirmed:
                return None
            state.confirmed = state.contiguous
            return Confirm(env.gateway_id, PIPELINE, 0, 1, state.contiguous, _now_ms())

    def _status(self, message: Message) -> None:
        """Until a gateway's first batch, its status says where its sequence starts."""
        try:
            status = GatewayStatus.from_json(message.payload)
        except ShoalError:
            return
        with self._lock:
            state = self._gateways.setdefault(status.gateway_id, _Gateway())
            if not state.started:
                state.contiguous = state.confirmed = status.first_unconfirmed_seq - 1


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


REPORT_S: Final = 0.02
"""How soon the sink reports changed counts (before: every 0.5 s, which a phase's end waited
for: up to 0.5 s added to a 3 s drain)."""


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


async def _main() -> int:
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    sink = Sink(SinkConfig(**orjson.loads(line)))
    stop, ready = asyncio.Event(), asyncio.Event()

    def wait_for_stop() -> None:
        for text in sys.stdin:
            if text.strip() == "stop":
                break
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_stop, daemon=True).start()
    task = asyncio.create_task(sink.run(stop, ready))
    ready_task = asyncio.create_task(ready.wait())
    await asyncio.wait({task, ready_task}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # failed before subscribing: raise
    _emit({"ready": True})
    # Counts go out within REPORT_S of a change (a timed phase ends on them) and at least
    # every 0.5 s.
    last, quiet_s = None, 0.0
    while not task.done():
        await asyncio.wait({task}, timeout=REPORT_S)
        snapshot = asdict(sink.snapshot())
        quiet_s += REPORT_S
        if snapshot != last or quiet_s >= 0.5:
            _emit(snapshot)
            last, quiet_s = snapshot, 0.0
    ready_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ready_task
    task.result()
    final = sink.snapshot()
    final.final = True
    _emit(asdict(final))
    return 0


def main() -> int:
    """Run the sink (see the module docstring for the protocol)."""
    try:
        return asyncio.run(_main())
    except ShoalError as exc:
        sys.stderr.write(f"shoal sink: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())


class SinkProcess:
    """The parent's handle on a sink running in a child process.

    Raises:
        BrokerError: the sink did not subscribe within ``timeout_s`` (its stderr included).
    """

    def __init__(self, config: SinkConfig, timeout_s: float = 15.0) -> None:
        self.counts = SinkCounts()
        self._ready = threading.Event()
        self._final = threading.Event()
        self._changed = threading.Condition()
        # A file, not a pipe: a chatty child must never block on a full pipe nobody reads.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives until close()
        self._process = spawn_tied(
            [sys.executable, "-m", "shoal.loadtest._sink"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C is the simulator's to handle
        )
        assert self._process.stdin is not None
        self._process.stdin.write(orjson.dumps(asdict(config)).decode() + "\n")
        self._process.stdin.flush()
        self._reader = threading.Thread(target=self._read, name="shoal-sink-reader", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout_s) or self._process.poll() is not None:
            self.stop(0.5)
            tail = self.stderr_tail()
            self.close()
            raise BrokerError(
                f"the load-test sink did not subscribe at {config.host}:{config.port} within "
                f"{timeout_s} s: {tail}"
            )

    @property
    def pid(self) -> int:
        """The sink's process id."""
        return self._process.pid

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if obj.get("ready"):
                self._ready.set()
                continue
            with self._changed:
                self.counts = SinkCounts(**obj)
                self._changed.notify_all()
            if self.counts.final:
                self._final.set()
        self._ready.set()  # the process ended: nobody waits for ever
        self._final.set()

    def wait_rows(self, rows: int, timeout_s: float) -> bool:
        """Wait until the sink has counted at least ``rows`` rows."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.counts.rows < rows:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._process.poll() is not None:
                    return False
                self._changed.wait(min(remaining, 0.5))
        return True

    def stop(self, timeout_s: float = 5.0) -> SinkCounts:
        """Ask the sink to stop, collect its final counts, reap it (kill if it hangs)."""
        process = self._process
        if process.stdin is not None and not process.stdin.closed:
            with contextlib.suppress(OSError):
                process.stdin.write("stop\n")
                process.stdin.close()
        self._final.wait(timeout_s)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._reader.join(timeout_s)
        if process.stdout is not None:
            process.stdout.close()
        return self.counts

    def stderr_tail(self) -> str:
        """The last lines the sink wrote to stderr."""
        self._stderr.seek(0)
        text = self._stderr.read()[-2000:].decode(errors="replace").strip()
        return text or "(no output)"

    def close(self) -> None:
        """Stop (if running) and release the stderr file."""
        self.stop(1.0)
        self._stderr.close()
