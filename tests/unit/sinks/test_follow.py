"""The sink core on the in-memory broker: a message is acknowledged only after its handler
returned, so one whose handler never finished (a crash) comes again to the next session."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from shoal.broker.memory import MemoryBroker
from shoal.broker.session import Message
from shoal.sinks import Backoff, FollowConfig, Follower, idempotency_key

GOLDEN = Path(__file__).parents[3] / "schemas" / "golden" / "outputs"


class Crashing:
    """Handles messages; the ``crash_on``-th one never returns (the process dies there)."""

    def __init__(self, crash_on: int = 0) -> None:
        self.crash_on = crash_on
        self.seen: list[bytes] = []

    async def handle(self, message: Message) -> None:
        self.seen.append(message.payload)
        if len(self.seen) == self.crash_on:
            await asyncio.Event().wait()  # hangs until cancelled: a kill -9


def test_unacknowledged_message_comes_again_after_a_crash() -> None:
    broker = MemoryBroker()
    config = FollowConfig(broker.settings, ("results/p",), "sink-1", receive_maximum=1)

    async def scenario() -> tuple[list[bytes], list[bytes]]:
        first = Crashing(crash_on=2)
        follower = Follower(config, first, session_factory=broker.session_factory)
        running = asyncio.create_task(follower.run())
        await asyncio.wait_for(follower.connected.wait(), 5)
        async with broker.session(broker.settings, "pub") as pub:
            for i in range(4):
                await pub.publish("results/p", b"m%d" % i)
        await asyncio.sleep(0.1)
        running.cancel()  # dies while handling m1
        await asyncio.gather(running, return_exceptions=True)
        second = Crashing()
        again = Follower(config, second, session_factory=broker.session_factory)
        resumed = asyncio.create_task(again.run())
        await asyncio.sleep(0.2)
        again.stop()
        stats = await resumed
        assert stats.acknowledged == len(second.seen)
        return first.seen, second.seen

    first, second = asyncio.run(scenario())
    assert first == [b"m0", b"m1"]
    assert second == [b"m1", b"m2", b"m3"]  # m0 was acknowledged, m1 was not


def test_backoff_doubles_up_to_its_maximum() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize("name", ["result-window.json", "result-window-correction.json"])
def test_idempotency_key_of_a_window_result_is_its_copy_identity(name: str) -> None:
    payload = (GOLDEN / name).read_bytes()
    body = orjson.loads(payload)
    key = idempotency_key(Message("results/temps", payload))
    identity = [body[k] for k in ("pipeline", "window", "start", "partition", "revision")]
    assert key == "/".join(map(str, ["result", *identity, body["rows"]]))
    # a re-published copy has a new emitted_at but the same key
    again = orjson.dumps({**body, "emitted_at": body["emitted_at"] + 5_000})
    assert idempotency_key(Message("results/temps", again)) == key


def test_idempotency_key_of_a_part_names_the_part() -> None:
    payload = (GOLDEN / "result-window-part.json").read_bytes()
    body = orjson.loads(payload)
    key = idempotency_key(Message("results/temps", payload))
    identity = [body[k] for k in ("pipeline", "window", "start", "partition", "revision")]
    assert key == "/".join(map(str, ["result", *identity, "part0", body["rows"]]))
    other = orjson.dumps({**body, "part": 1})
    assert idempotency_key(Message("results/temps", other)) != key


def test_idempotency_key_of_other_messages() -> None:
    alert = {
        "pipeline": "p",
        "alert": "hot",
        "key": "k",
        "window": "w",
        "start": 5,
        "state": "firing",
    }
    assert idempotency_key(Message("t", orjson.dumps(alert))) == "alert/p/hot/k/w/5/firing"
    one = idempotency_key(Message("t", b"\x93\x01\x02\x03"))
    assert one.startswith("sha256/")
    assert one == idempotency_key(Message("t", b"\x93\x01\x02\x03"))
    assert one != idempotency_key(Message("u", b"\x93\x01\x02\x03"))
