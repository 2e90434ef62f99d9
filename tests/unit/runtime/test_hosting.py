"""A pool combiner member: when it announces what it owns, whether its state folder is shared."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shoal.broker.memory import MemoryBroker
from shoal.clock import FakeClock
from shoal.runtime.hosting import ANNOUNCED_PER_TICK, CombinerHost, HostConfig, announcement_due
from shoal.schemas.topics import Topics

TICK_S, HEARTBEAT_S = 0.1, 1.0


def due(*, changed: bool, since_s: float, listed: int) -> bool:
    return announcement_due(
        changed=changed, since_s=since_s, listed=listed, tick_s=TICK_S, heartbeat_s=HEARTBEAT_S
    )


@pytest.mark.parametrize("listed", [0, 1, ANNOUNCED_PER_TICK - 1])
def test_a_small_change_goes_out_at_the_next_tick(listed: int) -> None:
    assert due(changed=True, since_s=TICK_S, listed=listed)
    assert not due(changed=False, since_s=TICK_S, listed=listed)  # nothing new: heartbeat
    assert due(changed=False, since_s=HEARTBEAT_S, listed=listed)


def test_a_large_changing_announcement_goes_out_once_per_tick_per_hundred_listed() -> None:
    listed = 10 * ANNOUNCED_PER_TICK  # 1,000 partitions starting one after the other
    assert not due(changed=True, since_s=TICK_S, listed=listed)
    assert not due(changed=True, since_s=9 * TICK_S, listed=listed)
    assert due(changed=True, since_s=10 * TICK_S, listed=listed)
    # the heartbeat is no faster than that either
    assert not due(changed=False, since_s=HEARTBEAT_S * 0.99, listed=listed)
    assert due(changed=False, since_s=HEARTBEAT_S, listed=listed)


def _members(memory: MemoryBroker, a: Path, b: Path) -> tuple[int, int]:
    """Two pool members with state folders ``a`` and ``b``: what each reports as unshared."""
    topics = Topics(root="shared-state")
    clock = FakeClock()

    def host(name: str, state: Path) -> CombinerHost:
        config = HostConfig(
            memory.settings, topics, state, name, tick_ms=20, shared_state_grace_ms=300
        )
        return CombinerHost(config, clock, session_factory=memory.session_factory)

    hosts = [host("c0", a), host("c1", b)]

    async def scenario() -> None:
        tasks = [asyncio.create_task(h.run()) for h in hosts]
        for _ in range(100):  # both see each other, then the grace passes
            await asyncio.sleep(0.02)
            clock.advance(20)
        for h in hosts:
            h.stop()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    return hosts[0].counters.unshared_state, hosts[1].counters.unshared_state


def test_members_report_a_state_folder_they_do_not_share(tmp_path: Path) -> None:
    assert _members(MemoryBroker(), tmp_path / "a", tmp_path / "b") == (1, 1)
    assert _members(MemoryBroker(), tmp_path / "s", tmp_path / "s") == (0, 0)
