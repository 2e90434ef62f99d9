"""``PooledOutputs`` fences a lease's end through ``FencedSession``, whatever its class.

The integration test (``tests/integration/test_pooled_outputs.py``) runs it on
``BatchedSession`` and Mosquitto; here the in-memory session, which is not one, must get the
same fence and reset, and a session factory without them is refused, not served unfenced.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.broker import AsyncSession
from shoal.broker._memory_session import MemorySession
from shoal.broker.memory import MemoryBroker
from shoal.broker.pooled import PooledOutputs
from shoal.broker.session import FencedSession, Session, SessionFactory, Will
from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError, ConfigError


def test_the_memory_session_is_fenced_and_the_aiomqtt_one_is_not() -> None:
    memory = MemoryBroker()
    assert isinstance(memory.session(memory.settings, "m"), FencedSession)
    assert not isinstance(AsyncSession(memory.settings, "a"), FencedSession)


def _counting(memory: MemoryBroker, syncs: list[str]) -> SessionFactory:
    """The memory broker's sessions, noting every ``sync`` (the fence) they are asked for."""

    class Counted(MemorySession):
        async def sync(self) -> None:
            syncs.append(self.client_id)
            await super().sync()

    def factory(
        settings: BrokerSettings, client_id: str, *, will: Will | None = None, **_: Any
    ) -> Session:
        return Counted(
            memory,
            settings,
            client_id,
            clean_start=True,
            session_expiry_s=0,
            receive_maximum=65_535,
            manual_ack=False,
            will=will,
            publish_timeout_s=5.0,
        )

    return factory


def test_a_lease_on_a_memory_session_ends_behind_the_fence_and_a_reset_fires_the_will() -> None:
    memory = MemoryBroker()
    syncs: list[str] = []

    async def scenario() -> None:
        pool = PooledOutputs(
            _counting(memory, syncs), memory.settings, "out", will=Will("gone/out", b"")
        )
        running = asyncio.create_task(pool.run())
        async with memory.session(memory.settings, "watcher") as watcher:
            await watcher.subscribe(["r/#", "gone/#"])
            async with pool.lease() as lease:
                lease.publish_started("r/1", b"a", qos=0)
            assert syncs == ["out"]  # the lease ended behind the fence
            with pytest.raises(BrokerError, match="ended"):
                await lease.publish("r/1", b"late", qos=0)
            pool.reset("a test")  # abort: the connection is lost, its will goes out
            received = watcher.messages()
            assert [(await anext(received)).topic for _ in range(2)] == ["r/1", "gone/out"]
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_factory_of_sessions_without_a_fence_is_refused() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        pool = PooledOutputs(AsyncSession, memory.settings, "out")
        with pytest.raises(ConfigError, match="AsyncSession cannot end a lease"):
            await pool.run()
        with pytest.raises(ConfigError, match="FencedSession"):
            async with pool.lease():
                pass

    asyncio.run(asyncio.wait_for(scenario(), 10))
