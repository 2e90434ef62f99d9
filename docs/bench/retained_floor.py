"""What 100,000 retained per-key results a second cost Mosquitto and their publisher.

``.venv/bin/python docs/bench/retained_floor.py KEYS STEPS [MODE]`` starts an embedded
Mosquitto (the ``dev`` profile), connects one ``BatchedSession`` (a combiner's output
session) and publishes, STEPS times, one retained QoS 0 message to each of KEYS topics
(``shoal/results/bench/<key>``, a scenario B per-key result of 420 bytes), then a QoS 1
message that it awaits: Mosquitto handles one connection's packets in order, so its PUBACK
says that the broker has taken the whole step. MODE ``each`` publishes with
``publish_started`` one message at a time (the combiner's path before ``publish_many``),
``many`` with ``publish_many`` (1,000 at a time, the window's fields as their shared
``head``). Prints per step: wall time, the publisher's CPU (user, system) and Mosquitto's
CPU (``/proc/PID/stat``), as JSON. Nobody subscribes: the broker's floor for storing
retained messages, before any dashboard fans them out.
Figures: docs/benchmarks.md, "Sliding: two stacks, one encoding, bulk per-key publishes".
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from shoal.broker import BatchedSession, EmbeddedBroker

PAYLOAD = (
    b'{"pipeline":"bench","window":"sliding-10s-1s","start":1700000000000,'
    b'"end":1700000010000,"revision":1,"emitted_at":1700000011000,"key":"gw00-s000000",'
    b'"rows":10,"batches":3,"count":10,"mean":20.44137570685536,"min":14.269716739736271,'
    b'"max":26.04511826552977,"stddev":0.38142126045355895,"first":16.986591727457043,'
    b'"last":21.085798501424595,"p50":24.04871950837918,"p95":18.762616930750315,'
    b'"p99":22.35433602930771}'
)


HEAD, ROW = PAYLOAD[:125], PAYLOAD[125:]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(broker: EmbeddedBroker, keys: int, steps: int, mode: str) -> list[dict[str, float]]:
    """Publish ``steps`` rounds of ``keys`` retained messages; figures per round."""
    pid = broker.pid
    assert pid is not None
    topics = [f"shoal/results/bench/gw{k % 10:02d}-s{k:06d}" for k in range(keys)]
    out = []
    async with BatchedSession(broker.settings, "retained-floor") as session:
        for _ in range(steps):
            wall, mine, theirs = time.perf_counter(), os.times(), cpu_s(pid)
            if mode == "many":  # as the combiner: the window's fields shared, then the row
                for offset in range(0, keys, 1_000):
                    await asyncio.sleep(0)
                    part = topics[offset : offset + 1_000]
                    session.publish_many([(t, ROW) for t in part], retain=True, head=HEAD)
            else:
                for offset in range(0, keys, 250):  # slices with the loop free, as a combiner
                    await asyncio.sleep(0)
                    for topic in topics[offset : offset + 250]:
                        session.publish_started(topic, PAYLOAD, qos=0, retain=True)
            await session.publish("shoal/results/bench/_step", b"", qos=1)
            out.append(
                {
                    "wall_s": round(time.perf_counter() - wall, 3),
                    "publisher_user_s": round(os.times().user - mine.user, 3),
                    "publisher_system_s": round(os.times().system - mine.system, 3),
                    "mosquitto_cpu_s": round(cpu_s(pid) - theirs, 3),
                }
            )
    return out


def main(keys: int, steps: int, mode: str) -> None:
    """Start a broker, run, print one JSON record."""
    with EmbeddedBroker() as broker:
        rounds = asyncio.run(run(broker, keys, steps, mode))
    record = {"keys": keys, "mode": mode, "payload_bytes": len(PAYLOAD), "steps": rounds}
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "each")
