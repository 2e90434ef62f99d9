"""``HeldSession``: publishes wait for the writes started before them, in order; a failed
write publishes nothing after it (on the in-memory broker; the combiner's use of it on
Mosquitto: ``tests/integration/test_close_log_order.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from shoal.broker.held import HeldSession
from shoal.broker.memory import MemoryBroker
from shoal.errors import PayloadTooLargeError


async def _received(watcher_messages: asyncio.Queue[bytes], count: int) -> list[bytes]:
    return [await asyncio.wait_for(watcher_messages.get(), 5) for _ in range(count)]


@contextlib.asynccontextmanager
async def _watched(memory: MemoryBroker) -> AsyncIterator[tuple[HeldSession, asyncio.Queue[bytes]]]:
    """A ``HeldSession`` over a session of ``memory``, and the payloads a watcher of ``t`` gets."""
    seen: asyncio.Queue[bytes] = asyncio.Queue()
    async with (
        memory.session(memory.settings, "watcher") as watcher,
        memory.session(memory.settings, "out") as out,
    ):
        await watcher.subscribe(["t"])

        async def listen() -> None:
            async for message in watcher.messages():
                seen.put_nowait(message.payload)

        listening = asyncio.create_task(listen())
        try:
            yield HeldSession(out), seen
        finally:
            listening.cancel()


def test_publishes_wait_for_the_writes_before_them_and_keep_their_order() -> None:
    memory = MemoryBroker(max_packet_size=1_000)

    async def scenario() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        async with _watched(memory) as (held, seen):
            rounds = []
            await held.publish("t", b"direct")  # no write pending: straight through
            rounds.append(await _received(seen, 1))
            first, second = loop.create_future(), loop.create_future()
            held.hold_until(first)
            a = held.publish_started("t", b"a")
            held.hold_until(second)
            b = held.publish_started("t", b"b")
            with pytest.raises(PayloadTooLargeError):  # refused at once, held or not
                held.publish_started("t", bytes(2_000))
            await asyncio.sleep(0.05)
            assert seen.empty()
            assert (a.done(), b.done(), held.held_total) == (False, False, 2)
            first.set_result(None)
            rounds.append(await _received(seen, 1))  # a only: b waits for the second write
            second.set_result(None)
            c = held.publish_started("t", b"c")  # behind b, though the writes are done
            await held.wait_published([a, b, c])
            rounds.append(await _received(seen, 2))
            return rounds

    assert asyncio.run(scenario()) == [[b"direct"], [b"a"], [b"b", b"c"]]


def test_a_failed_write_fails_what_it_held_and_everything_after() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with (
            memory.session(memory.settings, "watcher") as watcher,
            memory.session(memory.settings, "out") as out,
        ):
            await watcher.subscribe(["t"])
            held = HeldSession(out)
            ok, failed, later = (loop.create_future() for _ in range(3))
            held.hold_until(ok)
            a = held.publish_started("t", b"a")
            held.hold_until(failed)
            b = held.publish_started("t", b"b")
            held.publish_many([("t", b"b1"), ("t", b"b2")])  # never sent: after the failure
            held.hold_until(later)
            c = held.publish_started("t", b"c")
            # Completed together (one round of the writer): the failure in the middle is
            # seen before the write after it releases anything.
            ok.set_result(None)
            failed.set_exception(OSError("disk full"))
            later.set_result(None)
            await held.wait_published([a])
            for future in (b, c):
                with pytest.raises(OSError, match="disk full"):
                    await future
            with pytest.raises(OSError, match="disk full"):
                await held.publish("t", b"d")
            with pytest.raises(OSError, match="disk full"):
                held.publish_many([("t", b"d1")])
            message = await asyncio.wait_for(anext(aiter(watcher.messages())), 5)
            assert message.payload == b"a"
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(anext(aiter(watcher.messages())), 0.2)

    asyncio.run(scenario())


def test_publish_many_waits_behind_held_publishes_or_goes_straight_through() -> None:
    """A window's per-key results (``publish_many``, QoS 0) keep their place after held
    publishes, and go to the connection at once when nothing is held."""
    memory = MemoryBroker(max_packet_size=1_000)

    async def scenario() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        async with _watched(memory) as (held, seen):
            rounds = []
            held.publish_many([("t", b"k1"), ("t", b"k2")])  # nothing held: straight through
            rounds.append(await _received(seen, 2))
            write = loop.create_future()
            held.hold_until(write)
            window = held.publish_started("t", b"window")
            held.publish_many([("t", b"k3"), ("t", b"k4")])
            with pytest.raises(PayloadTooLargeError):  # refused at once, held or not
                held.publish_many([("t", b"k5"), ("t", bytes(2_000))])
            await asyncio.sleep(0.05)
            assert seen.empty()
            write.set_result(None)
            await held.wait_published([window])
            rounds.append(await _received(seen, 3))
            return rounds

    assert asyncio.run(scenario()) == [[b"k1", b"k2"], [b"window", b"k3", b"k4"]]
