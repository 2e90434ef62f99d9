"""``shoal bench pipeline`` with alerts: how long after its window's result an alert comes.

A probe subscribes to the pipeline's window results (``results/<pipeline>``, CONTRACT §14)
and its alerts (``shoal/alerts/<pipeline>/#``, §24.1) and keeps each message with the time
it came out of the session (one clock, one subscriber). It only stores while the run goes
on; the messages are parsed afterwards (``alert_after_result``), so a large window message
being parsed never delays the receive time of the alert behind it.

Each alert transition names its window (``window``, ``start``) and combiner ``partition``;
its result is that partition's window message (the first part received, for a split
window). Two figures per transition:

- ``received``: alert received minus result received, at the probe (what a dashboard
  subscribed to both sees);
- ``emitted``: the alert's ``at`` minus the result's ``emitted_at``, both the combiner's
  clock: from the start of emitting the window (before the result message is rendered)
  to the alert being handed to the connection, so it is an upper bound of "after the
  result" on the combiner's side.

Retained alerts (from before the probe subscribed) and transitions whose result was not
received are counted, not timed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import orjson

from shoal.broker import AsyncSession, BrokerSettings
from shoal.broker.recorder import RecordingSubscriber
from shoal.broker.session import Session
from shoal.schemas.topics import Topics

Received = tuple[float, bytes]
"""(monotonic seconds when received, payload)."""


@dataclass
class AlertProbe:
    """Stores the window results and alert transitions of one pipeline as they arrive."""

    pipeline: str
    topics: Topics
    results: list[Received] = field(default_factory=list)
    alerts: list[Received] = field(default_factory=list)
    retained_alerts: int = 0

    def filters(self) -> list[str]:
        """What to subscribe to."""
        return [self.topics.results(self.pipeline), self.topics.alerts(self.pipeline)]

    async def run(self, session: Session, subscribed: Callable[[], object] | None = None) -> None:
        """Subscribe and store until cancelled; ``subscribed`` is called once subscribed."""
        results_topic = self.topics.results(self.pipeline)
        await session.subscribe(self.filters(), qos=1)
        if subscribed is not None:
            subscribed()
        async for message in session.messages():
            now = time.monotonic()
            if message.topic == results_topic:
                self.results.append((now, message.payload))
            elif message.retain:
                self.retained_alerts += 1
            else:
                self.alerts.append((now, message.payload))


def _summary(values_ms: list[float]) -> dict[str, Any] | None:
    if not values_ms:
        return None
    ordered = sorted(values_ms)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2)

    return {"p50": q(0.50), "p99": q(0.99), "max": round(ordered[-1], 2), "count": len(ordered)}


def alert_after_result(
    results: Iterable[Received],
    alerts: Iterable[Received],
    *,
    since: float | None = None,
    until: float | None = None,
) -> dict[str, Any]:
    """Per alert transition, the time after its window's result; p50, p99, max, count.

    ``since``/``until`` (monotonic s): time only the transitions whose result was received
    in that span (the measured window of a run); the others are counted in ``outside``.
    """
    first: dict[tuple[str, int, int], tuple[float, int]] = {}
    for received, payload in results:
        head = orjson.loads(payload)
        ident = (str(head["window"]), int(head["start"]), int(head.get("partition", 0)))
        if ident not in first or received < first[ident][0]:
            first[ident] = (received, int(head["emitted_at"]))
    by_receipt: list[float] = []
    by_clock: list[float] = []
    states = {"firing": 0, "resolved": 0}
    unmatched = outside = 0
    for received, payload in alerts:
        alert = orjson.loads(payload)
        states[str(alert["state"])] = states.get(str(alert["state"]), 0) + 1
        ident = (str(alert["window"]), int(alert["start"]), int(alert.get("partition", 0)))
        result = first.get(ident)
        if result is None:
            unmatched += 1
            continue
        if (since is not None and result[0] < since) or (until is not None and result[0] > until):
            outside += 1
            continue
        by_receipt.append((received - result[0]) * 1000.0)
        by_clock.append(float(int(alert["at"]) - result[1]))
    return {
        "received": _summary(by_receipt),
        "emitted": _summary(by_clock),
        "transitions": states,
        "unmatched": unmatched,
        "outside_window": outside,
        "windows_received": len(first),
    }


async def stop(task: asyncio.Task[None]) -> None:
    """Cancel the probe's task and wait for it."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class ProbeProcess:
    """An ``AlertProbe`` in a process of its own, as a dashboard is.

    In the bench's own process the probe shares an event loop (and the GIL) with the
    monitor, which parses every heartbeat: its receive times then include waiting for that
    loop. Here it has its own connection, loop and interpreter; monotonic clocks are one
    clock across processes on Linux, so its times compare with the bench's measured span.
    """

    kind = "paho"

    def __init__(self, probe: AlertProbe, settings: BrokerSettings, client_id: str) -> None:
        self.probe = probe
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._ready = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_probe_main,
            args=(probe, settings, client_id, self._stop, self._ready, send),
            name="shoal-bench-alert-probe",
            daemon=True,
        )

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start the process and wait until it has subscribed."""
        self._process.start()
        if not await asyncio.to_thread(self._ready.wait, timeout_s):
            self._process.kill()
            raise RuntimeError(f"the alert probe did not subscribe within {timeout_s:.0f} s")

    async def finish(self, timeout_s: float = 30.0) -> AlertProbe:
        """Stop the probe and take what it stored (into ``self.probe``)."""
        self._stop.set()
        if await asyncio.to_thread(self._receive.poll, timeout_s):
            results, alerts, retained = self._receive.recv()
            self.probe.results.extend(results)
            self.probe.alerts.extend(alerts)
            self.probe.retained_alerts += retained
        await asyncio.to_thread(self._process.join, 5.0)
        if self._process.is_alive():
            self._process.kill()
        return self.probe


class RecorderProbe:
    """An ``AlertProbe`` fed by ``mosquitto_sub`` (``shoal.broker.recorder``): a subscriber in C.

    What a dashboard in Go or JavaScript sees, without paho's Python receive path in the
    figure (about half a millisecond per message: the 30th alert of a window would be stamped
    15 ms late by the probe itself). Arrival times are Unix time; they are moved onto the
    monotonic clock the bench's measured span uses (one offset, taken at the start).
    """

    kind = "mosquitto_sub"

    def __init__(
        self, probe: AlertProbe, settings: BrokerSettings, client_id: str, path: Path
    ) -> None:
        self.probe = probe
        self._subscriber = RecordingSubscriber(settings, client_id, probe.filters(), path)
        self._offset_s = 0.0

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start the subscriber and wait until it has subscribed."""
        await asyncio.to_thread(self._subscriber.start, timeout_s)
        self._offset_s = time.time() - time.monotonic()

    async def finish(self) -> AlertProbe:
        """Stop the subscriber and take what it recorded (into ``self.probe``)."""
        await asyncio.to_thread(self._subscriber.stop)
        probe = self.probe
        results_topic = probe.topics.results(probe.pipeline)
        for record in self._subscriber.records():
            received = (record.at_s - self._offset_s, record.payload)
            if record.topic == results_topic:
                probe.results.append(received)
            elif record.retain:
                probe.retained_alerts += 1
            else:
                probe.alerts.append(received)
        return probe


def _probe_main(  # noqa: PLR0917 - the process's whole context, passed once
    probe: AlertProbe,
    settings: BrokerSettings,
    client_id: str,
    stop_event: Event,
    ready: Event,
    send: Connection,
) -> None:
    """The probe process: subscribe, store until told to stop, send what was stored."""

    async def main() -> None:
        async with AsyncSession(settings, client_id) as session:
            task = asyncio.create_task(probe.run(session, ready.set))
            await asyncio.to_thread(stop_event.wait)
            await stop(task)

    try:
        asyncio.run(main())
    finally:
        send.send((probe.results, probe.alerts, probe.retained_alerts))
        send.close()
