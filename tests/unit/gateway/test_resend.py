"""Re-send policy: only when confirmations stall, oldest first, per-batch backoff (FakeClock)."""

from __future__ import annotations

import random

import pytest

from shoal.clock import FakeClock
from shoal.errors import ConfigError
from shoal.gateway._resend import ResendPolicy


def ms(clock: FakeClock) -> int:
    return int(clock.monotonic() * 1000)


def test_nothing_is_resent_while_confirmations_advance() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=1000, window=4)
    for seq in range(10):
        policy.sent(seq, ms(clock))
        clock.advance(300)
        policy.progressed(seq - 1, ms(clock))  # the pipeline trails by one batch
        assert policy.due(range(max(0, seq), seq + 1), ms(clock)) == []


def test_a_stall_resends_the_oldest_window_then_backs_off_exponentially() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=1000, window=3, cap_ms=5000)
    for seq in range(6):
        policy.sent(seq, ms(clock))
    outstanding = range(6)
    clock.advance(999)
    assert policy.due(outstanding, ms(clock)) == []
    clock.advance(1)
    assert policy.due(outstanding, ms(clock)) == [0, 1, 2]  # only the window
    for seq in (0, 1, 2):
        policy.sent(seq, ms(clock), resend=True)
    assert policy.due(outstanding, ms(clock)) == []
    # Second re-send waits 2 s, third 4 s, then the cap (5 s).
    waits = []
    for _ in range(4):
        waited = 0
        while not policy.due(outstanding, ms(clock)):
            clock.advance(100)
            waited += 100
        waits.append(waited)
        for seq in policy.due(outstanding, ms(clock)):
            policy.sent(seq, ms(clock), resend=True)
    assert waits == [2000, 4000, 5000, 5000]
    assert policy.attempts(0) == 5


def test_progress_forgets_confirmed_batches_and_restarts_the_stall_clock() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=1000, window=10)
    for seq in range(4):
        policy.sent(seq, ms(clock))
    clock.advance(1500)
    assert policy.due(range(4), ms(clock)) == [0, 1, 2, 3]
    policy.progressed(1, ms(clock))
    assert not policy.stalled(ms(clock))
    clock.advance(1000)
    assert policy.due(range(2, 4), ms(clock)) == [2, 3]
    policy.progressed(3, ms(clock))
    assert not policy.stalled(ms(clock) + 10_000)  # nothing outstanding: no stall at all


def test_an_idle_gateway_does_not_resend_its_first_new_batch_at_once() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=1000, window=10)
    policy.sent(0, ms(clock))
    clock.advance(100)
    policy.progressed(0, ms(clock))
    clock.advance(3_600_000)  # an hour without data
    policy.sent(1, ms(clock))
    assert policy.due([1], ms(clock)) == []
    clock.advance(1000)
    assert policy.due([1], ms(clock)) == [1]


def test_a_reconnect_restarts_the_clock() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=1000, window=10)
    policy.sent(0, ms(clock))
    clock.advance(900)
    policy.reconnected(ms(clock))
    policy.sent(0, ms(clock))  # the gateway re-publishes everything after a reconnect
    clock.advance(900)
    assert policy.due([0], ms(clock)) == []
    clock.advance(100)
    assert policy.due([0], ms(clock)) == [0]


def test_a_reported_gap_is_resent_without_waiting_for_a_stall() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=10_000, window=2, gap_ms=2_000)
    for seq in range(8):
        policy.sent(seq, ms(clock))
    clock.advance(1_999)
    assert policy.due(range(8), ms(clock), frozenset({5})) == []  # sent too recently
    clock.advance(1)
    # Beyond the stall window (2) too: a reported seq is named exactly.
    assert policy.due(range(8), ms(clock), frozenset({5})) == [5]
    assert not policy.stalled(ms(clock))
    policy.sent(5, ms(clock), resend=True)
    clock.advance(1_000)
    assert policy.due(range(8), ms(clock), frozenset({5})) == []  # once per gap_ms
    clock.advance(1_000)
    assert policy.due(range(8), ms(clock), frozenset({5})) == [5]


def test_a_reported_seq_that_is_not_outstanding_is_not_sent() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=10_000, window=4)
    for seq in range(3):
        policy.sent(seq, ms(clock))
    clock.advance(5_000)
    # 1 is in flight again (not outstanding); 7 was never sent on this connection.
    assert policy.due([0, 2], ms(clock), frozenset({1, 2, 7})) == [2]


def test_jitter_spreads_the_resends_of_batches_sent_together() -> None:
    clock = FakeClock()
    policy = ResendPolicy(after_ms=1000, window=64, jitter=0.5, rng=random.Random(7))
    for seq in range(32):
        policy.sent(seq, ms(clock))
    sends: dict[int, list[int]] = {seq: [] for seq in range(32)}
    while any(len(times) < 2 for times in sends.values()):
        clock.advance(10)
        for seq in policy.due(range(32), ms(clock)):
            sends[seq].append(ms(clock))
            policy.sent(seq, ms(clock), resend=True)
    # The stall starts the first round for all at once; from then on each batch has its own
    # moment, never sooner than (1 - jitter) x its backoff (2 s after the first re-send).
    assert {times[0] for times in sends.values()} == {1000}
    second = [times[1] for times in sends.values()]
    assert min(second) >= 1000 + 1000
    assert len(set(second)) > 16


def test_jitter_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="jitter"):
        ResendPolicy(after_ms=1000, window=4, jitter=1.0)
