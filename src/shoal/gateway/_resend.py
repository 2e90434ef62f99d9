"""When to re-send unconfirmed batches: stalled confirmations, per-batch exponential backoff.

Pure: time comes in as arguments (monotonic milliseconds), so tests drive it with
``FakeClock``. Re-sending after a reconnect is not decided here (the gateway re-publishes
everything unconfirmed then); this policy covers a connection that stays up while the
pipeline stops confirming, without flooding a pipeline that is merely slow.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from shoal.errors import ConfigError

BACKOFF_CAP_MS: Final = 60_000


@dataclass(frozen=True, slots=True)
class _Sent:
    """One outstanding batch: re-sends so far, and from when it may go again."""

    attempts: int
    stall_at_ms: int  # re-send on a stall from then
    gap_at_ms: int  # re-send when reported missing from then


class ResendPolicy:
    """Decides which published-but-unconfirmed batches to publish again.

    Two triggers:

    * **Reported gaps** (fast): a combiner names seqs it has waited for while holding later
      batches (``Confirm.missing``). Such a seq is re-sent once it was last sent at least
      ``gap_ms`` ago, whether or not confirmations advance: a loss in the middle of a
      flowing stream is repaired in about a confirmation interval.
    * **Stalls** (the safety net, when nothing is reported: the pipeline is down, or lost
      everything): a batch becomes eligible ``after_ms`` after it was last sent, and each
      re-send doubles that wait (capped at ``cap_ms``). Nothing is re-sent this way while
      confirmations advance: only when they have not moved for ``after_ms`` with batches
      outstanding, and then only the ``window`` oldest outstanding batches.

    Every wait is shortened by a random share of up to ``jitter`` (exponential backoff with
    jitter). Besides spreading load, it matters for shared subscriptions: the broker deals
    a group's messages strictly in turn, so batches re-sent together, in the same order,
    would meet the same members every time, and a member that drops what it is dealt (one
    without read access, see ``docs/guarantees.md``) would get the same seqs on every round.

    Args:
        after_ms: stall time before re-sending, and the first per-batch backoff.
        window: how many of the oldest outstanding batches may be re-sent.
        cap_ms: the longest per-batch backoff.
        gap_ms: least time between two sends of a batch reported missing.
        jitter: the largest share, in [0, 1), by which a wait is shortened at random.
        rng: the randomness (tests seed it).
    """

    def __init__(
        self,
        after_ms: int,
        window: int,
        cap_ms: int = BACKOFF_CAP_MS,
        gap_ms: int = 2_000,
        *,
        jitter: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if after_ms <= 0 or window <= 0 or gap_ms <= 0:
            raise ConfigError("after_ms, window and gap_ms must be positive")
        if not 0.0 <= jitter < 1.0:
            raise ConfigError(f"jitter must be in [0, 1), not {jitter}")
        self.after_ms = after_ms
        self.window = window
        self.cap_ms = max(cap_ms, after_ms)
        self.gap_ms = gap_ms
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._progress_ms: int | None = None
        self._sent: dict[int, _Sent] = {}  # the outstanding batches, by seq

    def backoff_ms(self, attempts: int) -> int:
        """Wait before the next re-send of a batch already re-sent ``attempts`` times."""
        return min(self.after_ms << min(attempts, 30), self.cap_ms)

    def sent(self, seq: int, now_ms: int, *, resend: bool = False) -> None:
        """Record that ``seq`` was published (``resend``: by this policy)."""
        if not self._sent and self._progress_ms is None:
            self._progress_ms = now_ms  # the stall clock starts with the first outstanding batch
        attempts = self.attempts(seq) + (1 if resend else 0)
        spread = 1.0 - self.jitter * self._rng.random()
        self._sent[seq] = _Sent(
            attempts,
            stall_at_ms=now_ms + round(self.backoff_ms(attempts) * spread),
            gap_at_ms=now_ms + round(self.gap_ms * spread),
        )

    def progressed(self, confirmed_seq: int, now_ms: int) -> None:
        """Confirmations advanced to ``confirmed_seq``: forget those batches, reset the stall."""
        for seq in [s for s in self._sent if s <= confirmed_seq]:
            del self._sent[seq]
        self._progress_ms = now_ms if self._sent else None

    def reconnected(self, now_ms: int) -> None:
        """Everything outstanding is being re-published on a new connection: restart the clock."""
        self._progress_ms = now_ms if self._sent else None

    def stalled(self, now_ms: int) -> bool:
        """Whether confirmations have not advanced for ``after_ms`` with batches outstanding."""
        return self._progress_ms is not None and now_ms - self._progress_ms >= self.after_ms

    def due(
        self, outstanding: Iterable[int], now_ms: int, missing: frozenset[int] = frozenset()
    ) -> list[int]:
        """Which of ``outstanding`` (published, unconfirmed seqs, oldest first) to re-send now.

        ``missing``: seqs a combiner reported missing (see the class docstring).
        """
        stalled = self.stalled(now_ms)
        if not stalled and not missing:
            return []
        last_missing = max(missing, default=-1)
        due: list[int] = []
        for count, seq in enumerate(outstanding):
            if count >= self.window and seq > last_missing:
                break
            sent = self._sent.get(seq)  # None: never sent through this policy, due at once
            reported = seq in missing and (sent is None or now_ms >= sent.gap_at_ms)
            overdue = (
                stalled and count < self.window and (sent is None or now_ms >= sent.stall_at_ms)
            )
            if reported or overdue:
                due.append(seq)
        return due

    def attempts(self, seq: int) -> int:
        """How many times ``seq`` was re-sent by this policy."""
        sent = self._sent.get(seq)
        return 0 if sent is None else sent.attempts
