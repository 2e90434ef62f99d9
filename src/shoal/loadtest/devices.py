"""Simulated devices that publish like real ones: JSON objects, raw values, Sparkplug B.

A ``DeviceFleet`` makes the messages of ``count`` devices, one per device and step, with
values that are a pure function of (device, step), so a test or a benchmark knows exactly
which measurements were published (``expected_rows``) and can hold shoal's results against
plain polars over them. ``DevicePublisher`` sends a fleet's messages to a broker, QoS 1, at
a rate, and counts PUBACKs; ``shoal simulate --devices`` drives it.

Sparkplug payloads are built by ``shoal.loadtest.sparkplug_encode`` with the protobuf
classes directly, independent of the adapter's decoder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

import orjson
import polars as pl

from shoal.broker import ThreadedSession
from shoal.broker.session import PublishHandle, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError, ConfigError

DEVICE_KINDS: Final = ("json", "raw", "sparkplug")
"""What ``--devices`` accepts."""

DEFAULT_PREFIX: Final = {"json": "sensors", "raw": "home", "sparkplug": "spBv1.0"}
"""The first topic level each kind publishes under (the example mappings read these)."""

STEP_MS: Final = 1_000
"""Event time between two steps of a device (JSON and Sparkplug carry it; raw values do not)."""

SITES: Final = 4
"""JSON devices are spread over this many sites (``sensors/site<k>/dev<n>``)."""


def temp(device: int, step: int) -> float:
    """A device's temperature at a step (exactly representable: tenths of small integers)."""
    return ((device * 7 + step * 13) % 400) / 10.0


def hum(device: int, step: int) -> float:
    """A device's humidity at a step."""
    return float((device * 3 + step * 5) % 100)


@dataclass(frozen=True, slots=True)
class DeviceFleet:
    """``count`` devices of one kind.

    Attributes:
        kind: ``json``, ``raw`` or ``sparkplug``.
        count: devices.
        prefix: first topic level(s): ``sensors``, ``home``, ``spBv1.0`` by default; a test
            puts its private root in front.
        start_ms: event time of step 0 (JSON and Sparkplug).
        step_ms: event time between two steps of a device.
        group: Sparkplug group id.
        nodes: Sparkplug edge nodes the devices are spread over.
    """

    kind: str
    count: int
    prefix: str = ""
    start_ms: int = 1_700_000_000_000
    step_ms: int = STEP_MS
    group: str = "plant"
    nodes: int = 2

    def __post_init__(self) -> None:
        """Refuse what cannot work."""
        if self.kind not in DEVICE_KINDS:
            raise ConfigError(f"--devices must be one of {list(DEVICE_KINDS)}, not {self.kind!r}")
        if self.count < 1:
            raise ConfigError(f"--count must be at least 1, not {self.count}")

    @property
    def root(self) -> str:
        """The topic prefix in use."""
        return self.prefix or DEFAULT_PREFIX[self.kind]

    def ts(self, step: int) -> int:
        """Event time of a step."""
        return self.start_ms + step * self.step_ms

    def topic(self, device: int) -> str:
        """Where a JSON or raw device publishes."""
        if self.kind == "json":
            return f"{self.root}/site{device % SITES}/dev{device}"
        return f"{self.root}/room{device}/temp"

    def message(self, device: int, step: int) -> tuple[str, bytes]:
        """One JSON or raw device message."""
        if self.kind == "json":
            body = {"temp": temp(device, step), "hum": hum(device, step), "ts": self.ts(step)}
            return self.topic(device), orjson.dumps(body)
        return self.topic(device), repr(temp(device, step)).encode()

    def messages(self, first_step: int, steps: int) -> Iterator[tuple[str, bytes]]:
        """Every device's messages for ``steps`` steps (Sparkplug: births first, then data)."""
        if self.kind == "sparkplug":
            from shoal.loadtest.sparkplug_encode import SparkplugFleet  # noqa: PLC0415

            nodes = SparkplugFleet(
                self.root, self.group, self.nodes, self.count, self.ts, temp, hum
            )
            yield from nodes.messages(first_step, steps)
            return
        for step in range(first_step, first_step + steps):
            for device in range(self.count):
                yield self.message(device, step)

    def expected_rows(self, steps: int) -> pl.DataFrame:
        """What the adapter must turn ``steps`` steps into: sensor_id, ts, value, name.

        Raw devices carry no event time: ``ts`` is the step's (the caller compares per key,
        over all windows, or replaces it).
        """
        rows: list[tuple[str, int, float, str]] = []
        for step in range(steps):
            for device in range(self.count):
                if self.kind == "json":
                    sensor = f"site{device % SITES}.dev{device}"
                    rows.append((sensor, self.ts(step), temp(device, step), "temp"))
                    rows.append((sensor, self.ts(step), hum(device, step), "hum"))
                elif self.kind == "raw":
                    rows.append((f"room{device}", self.ts(step), temp(device, step), "temp"))
                else:
                    node = f"node{device % min(self.nodes, self.count)}"
                    sensor = f"{self.group}.{node}.dev{device}"
                    rows.append((sensor, self.ts(step), temp(device, step), "temp"))
                    rows.append((sensor, self.ts(step), hum(device, step), "hum"))
        return pl.DataFrame(
            rows,
            schema={"sensor_id": pl.String, "ts": pl.Int64, "value": pl.Float64, "name": pl.String},
            orient="row",
        )


@dataclass
class PublishReport:
    """What a ``DevicePublisher`` did.

    Attributes:
        sent: messages handed to the broker.
        acknowledged: of those, PUBACKed.
        seconds: wall time of the publishing.
    """

    sent: int = 0
    acknowledged: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Messages per second achieved."""
        return self.sent / self.seconds if self.seconds > 0 else 0.0


class DevicePublisher:
    """Publishes device messages QoS 1 over one connection, at most ``rate`` per second.

    Args:
        settings: the broker.
        rate: messages per second over all devices (0: as fast as the connection goes).
        window: publishes in flight without PUBACK at most.
    """

    def __init__(self, settings: BrokerSettings, *, rate: float = 0.0, window: int = 1000) -> None:
        self.settings = settings
        self.rate = rate
        self.window = window
        self._done = threading.Event()
        self._session = ThreadedSession(settings, unique_client_id("devices"))

    def run(
        self,
        messages: Iterator[tuple[str, bytes]],
        *,
        stop: threading.Event | None = None,
        progress: Callable[[PublishReport], None] | None = None,
    ) -> PublishReport:
        """Publish everything (until ``stop``), wait for the PUBACKs, disconnect."""
        report = PublishReport()
        session = self._session
        session.start()
        if not session.wait_connected(10):
            raise BrokerError(f"cannot connect to {self.settings.url}")
        started = time.monotonic()
        inflight: list[PublishHandle] = []
        next_report = started + 1.0
        try:
            for topic, payload in messages:
                if stop is not None and stop.is_set():
                    break
                if self.rate > 0:
                    due = started + report.sent / self.rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                inflight.append(self._publish(topic, payload))
                report.sent += 1
                if len(inflight) >= self.window:
                    report.acknowledged += _settle(inflight[: self.window // 2], report)
                    del inflight[: self.window // 2]
                if progress is not None and time.monotonic() >= next_report:
                    next_report += 1.0
                    progress(report)
            report.acknowledged += _settle(inflight, report)
            report.seconds = time.monotonic() - started
        finally:
            session.stop()
        return report

    def _publish(self, topic: str, payload: bytes) -> PublishHandle:
        while True:
            try:
                return self._session.publish(topic, payload, qos=1)
            except BrokerError:  # disconnected: wait for the reconnect, then go on
                self._session.wait_connected(5)


def _settle(handles: list[PublishHandle], report: PublishReport) -> int:
    done = 0
    for handle in handles:
        try:
            if handle.wait(30):
                done += 1
        except BrokerError as exc:
            report.failed.append(str(exc))
    return done
