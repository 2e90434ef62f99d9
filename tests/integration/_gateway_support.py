"""Test-side helpers for gateway integration tests: a small confirmer standing in for the
combiner (which comes later), and a subprocess runner."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from shoal.broker import ThreadedSession
from shoal.broker.session import GatewaySession, Message, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError
from shoal.schemas import decode_batch
from shoal.schemas.control import Confirm
from shoal.schemas.topics import Topics


@dataclass
class Received:
    """Everything the confirmer saw of one gateway."""

    rows: dict[int, np.ndarray] = field(default_factory=dict)  # seq -> values
    deliveries: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    mismatched: list[int] = field(default_factory=list)  # seqs delivered with other rows
    contiguous: int = -1


class Confirmer:
    """Subscribes to a stream's ingest topics, decodes every batch, and publishes a retained
    ``Confirm`` (one pipeline, ``partitions`` partitions) for the highest contiguous seq of
    each gateway, like the real combiner will.

    ``holding``: while True, nothing is confirmed (the gateways keep their batches spooled);
    the next connect confirms what arrived meanwhile."""

    def __init__(
        self,
        settings: BrokerSettings,
        topics: Topics,
        stream: str,
        *,
        pipeline: str = "test",
        partitions: int = 1,
    ) -> None:
        self.topics = topics
        self.stream = stream
        self.pipeline = pipeline
        self.partitions = partitions
        self.lock = threading.Lock()
        self.gateways: dict[str, Received] = defaultdict(Received)
        self.payload_sizes: list[int] = []
        self.content_types: set[str | None] = set()
        self.errors: list[str] = []
        self.holding = False
        self.session = ThreadedSession(
            settings,
            unique_client_id("confirmer"),
            on_message=self._on_message,
            on_connect=self._on_connect,
        )

    def __enter__(self) -> Confirmer:
        self.session.start()
        assert self.session.wait_connected(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.stop()

    def _on_connect(self, session: GatewaySession) -> None:
        session.subscribe(self.topics.ingest_filter(self.stream), qos=1)
        with self.lock:  # retained confirms may have died with a killed broker
            for gateway in self.gateways:
                self._confirm(gateway)

    def _on_message(self, message: Message) -> None:
        try:
            batch = decode_batch(message.payload, content_type=message.content_type)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on
            self.errors.append(repr(exc))
            return
        env = batch.envelope
        values = batch.frame.get_column("value").to_numpy()
        with self.lock:
            self.payload_sizes.append(len(message.payload))
            self.content_types.add(message.content_type)
            got = self.gateways[env.gateway_id]
            got.deliveries[env.seq] += 1
            if env.seq in got.rows:
                if not np.array_equal(got.rows[env.seq], values):
                    got.mismatched.append(env.seq)
                return
            got.rows[env.seq] = values
            while got.contiguous + 1 in got.rows:
                got.contiguous += 1
            self._confirm(env.gateway_id)

    def _confirm(self, gateway: str) -> None:
        if self.holding:
            return
        seq = self.gateways[gateway].contiguous
        for partition in range(self.partitions):
            confirm = Confirm(gateway, self.pipeline, partition, self.partitions, seq, 1)
            with contextlib.suppress(BrokerError):  # disconnected: re-sent on connect
                self.session.publish(
                    self.topics.confirm(gateway, self.pipeline, partition),
                    confirm.to_json(),
                    retain=True,
                )

    def wait_contiguous(self, gateway: str, seq: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.gateways[gateway].contiguous >= seq:
                    return True
            time.sleep(0.02)
        return False

    def snapshot(self, gateway: str) -> Received:
        with self.lock:
            got = self.gateways[gateway]
            return Received(
                dict(got.rows), dict(got.deliveries), list(got.mismatched), got.contiguous
            )


def stop_process(proc: subprocess.Popen[str]) -> None:
    """Terminate, then kill; always reaps."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
