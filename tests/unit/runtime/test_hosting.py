"""When a pool combiner announces what it owns (``announcement_due``)."""

from __future__ import annotations

import pytest

from shoal.runtime.hosting import ANNOUNCED_PER_TICK, announcement_due

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
