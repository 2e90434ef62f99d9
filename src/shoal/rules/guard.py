"""Runs a pipeline's batch work that calls user functions: in a thread, under a time budget.

The isolation is in-process, with a watchdog (docs/rules.md, "Isolation and its limits"):

- each guarded call runs in a fresh daemon thread while the worker's event loop waits for
  it without blocking (other pipelines' batches keep flowing);
- past the budget the call is abandoned: the batch fails with ``function_timeout`` and the
  thread is sent an asynchronous ``FunctionInterrupted`` (``PyThreadState_SetAsyncExc``),
  which stops pure-Python code at its next bytecode. Code blocked in C (``time.sleep``, a
  long numpy or polars call) cannot be interrupted: until that call returns, the pipeline's
  further batches fail at once with ``function_stuck`` (one runaway thread per pipeline at
  most, never a queue of them);
- failures are counted per reason, and ``consecutive`` of them mark the pipeline
  ``degraded`` until a batch succeeds again; one degraded by *time* is not run for a while
  (``function_degraded``, see ``FunctionGuard``).

What this cannot do, and a subprocess would: bound memory, survive a crash in native code
(a segfault takes the worker down) or take back the CPU of code stuck in C. Imports
``shoal.errors`` and ``rules.functions`` only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from shoal.errors import FunctionError
from shoal.rules.functions import guarded

T = TypeVar("T")

PROBE_S: Final = 5.0
"""How long a pipeline degraded by time is not run before one batch probes it again."""
INTERRUPT_GRACE_S: Final = 0.05
"""How long a call past its budget may take to stop after the interrupt before the guard
calls it stuck."""


class FunctionInterrupted(BaseException):
    """Raised asynchronously into a call past its budget.

    A ``BaseException``: user code's ``except Exception`` does not swallow it.
    """


@dataclass
class FunctionHealth:
    """What one pipeline's functions did in this worker.

    Attributes:
        batches_ok: guarded batches that succeeded.
        failures: failed batches by reason (``FUNCTION_REASONS``).
        consecutive: failures since the last success.
        last_error: the last failure's message (None: none yet).
    """

    batches_ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    consecutive: int = 0
    last_error: str | None = None

    def as_dict(self, degrade_after: int) -> dict[str, Any]:
        """The heartbeat form (``metrics-worker.schema.json``, ``functions``)."""
        return {
            "batches_ok": self.batches_ok,
            "failures": dict(self.failures),
            "consecutive_failures": self.consecutive,
            "degraded": self.consecutive >= degrade_after,
            "last_error": self.last_error,
        }


class FunctionGuard:
    """Runs one pipeline's guarded work, one call at a time, each within ``budget_s``.

    A pipeline ``degraded`` by time (its last ``degrade_after`` batches all ran past the
    budget, or were stuck behind one that did) is not run again for ``probe_s``: its batches
    fail at once as ``function_degraded``, then one batch probes. A worker acknowledges
    deliveries in arrival order, so every batch that waits out a budget also holds back the
    acknowledgements (and, through ``receive_maximum``, the deliveries) of the other
    pipelines it serves; failing fast bounds that to ``degrade_after`` budgets per probe.

    Args:
        budget_s: the per-batch budget (the pipeline's functions' ``budget_ms``, summed).
        degrade_after: consecutive failures after which ``degraded`` is true.
        monotonic: the worker clock's monotonic seconds.
        probe_s: how long a pipeline degraded by time is not run before a probe.
    """

    def __init__(
        self,
        budget_s: float,
        degrade_after: int,
        monotonic: Callable[[], float],
        probe_s: float = PROBE_S,
    ) -> None:
        self.budget_s = budget_s
        self.degrade_after = degrade_after
        self.health = FunctionHealth()
        self._monotonic = monotonic
        self._probe_s = probe_s
        self._slow = 0  # consecutive failures that cost time (timeouts, stuck)
        self._resting_until: float | None = None
        self._lock: asyncio.Lock | None = None
        self._runaway: concurrent.futures.Future[Any] | None = None

    @property
    def degraded(self) -> bool:
        """Whether the last ``degrade_after`` guarded batches all failed."""
        return self.health.consecutive >= self.degrade_after

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` in a thread within the budget; failures counted.

        Raises:
            FunctionError: ``work`` raised one (or anything: user code may make ours
                fail), ran past the budget (``function_timeout``), or an earlier call that
                ran past it has not returned yet (``function_stuck``).
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one call at a time: a batch's partials keep their order
            try:
                self._check_resting()
                result = await self._run(work)
            except FunctionError as exc:
                self._failed(exc)
                raise
            self.health.batches_ok += 1
            self.health.consecutive = self._slow = 0
            self._resting_until = None
            return result

    def _check_resting(self) -> None:
        if self._resting_until is None:
            return
        if self._monotonic() < self._resting_until:
            raise FunctionError(
                f"the pipeline is degraded: its last {self._slow} batches ran past their "
                f"budget, so batches are not run until a probe (every {self._probe_s:g} s) "
                "succeeds",
                reason="function_degraded",
            )
        self._resting_until = None  # this batch is the probe

    def _failed(self, exc: FunctionError) -> None:
        self.health.failures[exc.reason] += 1
        self.health.consecutive += 1
        if exc.reason != "function_degraded":
            self.health.last_error = str(exc)
        if exc.reason in {"function_timeout", "function_stuck"}:
            self._slow += 1
        elif exc.reason != "function_degraded":
            self._slow = 0
        if exc.reason != "function_degraded" and self._slow >= self.degrade_after:
            self._resting_until = self._monotonic() + self._probe_s

    async def _run(self, work: Callable[[], T]) -> T:
        if self._runaway is not None and not self._runaway.done():
            raise FunctionError(
                "an earlier call of this pipeline's functions ran past its budget and has not "
                "returned yet (blocked outside Python code)",
                reason="function_stuck",
            )
        self._runaway = None
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        thread = threading.Thread(target=_runner, args=(work, done), daemon=True)
        thread.start()
        waiter = asyncio.wrap_future(done)
        try:
            # shield: a timeout must not cancel ``done``, which the thread still completes
            return await asyncio.wait_for(asyncio.shield(waiter), self.budget_s)
        except TimeoutError:
            waiter.add_done_callback(_retrieve)  # its late outcome is of no interest
            if not done.done() and thread.ident is not None:
                _interrupt(thread.ident)
                # A moment for Python code to take the interrupt and end: then the next
                # batch gets a fresh thread instead of ``function_stuck``.
                with contextlib.suppress(TimeoutError, FunctionError):
                    await asyncio.wait_for(asyncio.shield(waiter), INTERRUPT_GRACE_S)
            self._runaway = None if done.done() else done
            raise FunctionError(
                f"the pipeline's functions ran past their budget of "
                f"{round(self.budget_s * 1000)} ms on this batch",
                reason="function_timeout",
            ) from None


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _runner(work: Callable[[], T], done: concurrent.futures.Future[T]) -> None:
    try:
        with guarded():
            result = work()
        done.set_result(result)
    except FunctionError as exc:
        done.set_exception(exc)
    except FunctionInterrupted:
        done.set_exception(FunctionError("interrupted past its budget", reason="function_timeout"))
    except Exception as exc:  # noqa: BLE001 - user code may make ours fail in any way
        error = FunctionError(
            f"the batch failed in the pipeline's functions: {type(exc).__name__}: {exc}",
            reason="function_error",
        )
        error.__cause__ = exc
        done.set_exception(error)
    except BaseException:  # noqa: BLE001 - a late interrupt after the work finished: ignore
        if not done.done():
            done.set_exception(FunctionError("interrupted", reason="function_timeout"))


def _interrupt(ident: int) -> None:
    """Raise ``FunctionInterrupted`` in the thread ``ident`` at its next Python bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(FunctionInterrupted)
    )
