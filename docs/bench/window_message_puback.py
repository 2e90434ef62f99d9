"""The broker hop of a window message: QoS 1 publish of a 2.5 MB payload until its PUBACK.

Run from the repository root (docs/benchmarks.md, "Worker and close path at scenarios A and
B: first/last by index, the close log's flush measured, the array rendered ahead")::

    python docs/bench/window_message_puback.py [SAMPLES] [--alone]

Starts the embedded broker (Mosquitto, dev profile) in a temporary folder, one subscriber
(an ``AsyncSession``, as ``shoal bench pipeline``'s result recorder) to the results topic, and
a publisher on the session a combiner publishes its results on
(``default_output_session_factory``). Publishes SAMPLES (default 40) messages of each size,
one a second as windows close at scenario B, and prints p50/p99/max of publish → PUBACK in
ms for a 1 KB message and for a 2.5 MB one (scenario B's JSON window message), each also
until the subscriber has it. ``--alone``: no subscriber (the broker routes to nobody).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from shoal.broker import AsyncSession, default_output_session_factory
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id

TOPIC = "shoal/results/probe"
SIZES = {"1KB": 1_000, "2.5MB": 2_500_000}


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(ordered[len(ordered) // 2], 2),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2),
        "max": round(ordered[-1], 2),
    }


async def _probe(broker: EmbeddedBroker, samples: int, *, alone: bool) -> dict[str, object]:
    received: asyncio.Queue[float] = asyncio.Queue()
    record: dict[str, object] = {}
    async with AsyncSession(broker.settings, unique_client_id("probe-sub")) as subscriber:
        if not alone:
            await subscriber.subscribe([TOPIC], qos=1)

        async def consume() -> None:
            async for _ in subscriber.messages():
                received.put_nowait(time.perf_counter())

        listening = asyncio.create_task(consume())
        session_type = default_output_session_factory()
        async with session_type(broker.settings, unique_client_id("probe-pub")) as publisher:
            for name, size in SIZES.items():
                payload = b"x" * size
                puback, delivered = [], []
                for _ in range(samples):
                    started = time.perf_counter()
                    await publisher.publish_started(TOPIC, payload, qos=1)
                    puback.append((time.perf_counter() - started) * 1000)
                    if not alone:
                        arrived = await asyncio.wait_for(received.get(), 30)
                        delivered.append((arrived - started) * 1000)
                    await asyncio.sleep(1.0)
                record[name] = {"puback_ms": _summary(puback)}
                if delivered:
                    record[name] = {**record[name], "delivered_ms": _summary(delivered)}
        listening.cancel()
    return record


def main() -> None:
    """Start the broker, probe, print one JSON line."""
    samples = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 40
    with tempfile.TemporaryDirectory() as folder:
        broker = EmbeddedBroker("dev", data_dir=Path(folder))
        broker.start()
        try:
            record = asyncio.run(_probe(broker, samples, alone="--alone" in sys.argv))
        finally:
            broker.stop()
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
