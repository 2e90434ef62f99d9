"""Runs user functions in a thread, under a time budget: a worker's batches, a combiner's calls.

``FunctionGuard`` runs a worker's batch work for a pipeline with functions (awaited: the
worker's loop goes on); ``CallGuard`` a combiner's UDAF ``merge``/``finalize`` calls (the
combiner's core is synchronous: it blocks, for one budget at most). The isolation is
in-process, with a watchdog (docs/rules.md, "Isolation and its limits"):

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

from shoal._futures import ignore_outcome
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


class _Watchdog:
    """What both guards share: the health counts, the runaway thread, the rest after timeouts.

    Args:
        budget_s: the default budget per call.
        degrade_after: consecutive failures after which ``degraded`` is true.
        monotonic: the process clock's monotonic seconds.
        probe_s: how long a guard degraded by time refuses calls before one probes.
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
        self._runaway: concurrent.futures.Future[Any] | None = None

    @property
    def degraded(self) -> bool:
        """Whether the last ``degrade_after`` guarded calls all failed."""
        return self.health.consecutive >= self.degrade_after

    def _succeeded(self) -> None:
        self.health.batches_ok += 1
        self.health.consecutive = self._slow = 0
        self._resting_until = None

    def _check_resting(self) -> None:
        if self._resting_until is None:
            return
        if self._monotonic() < self._resting_until:
            raise FunctionError(
                f"the pipeline is degraded: its last {self._slow} calls ran past their "
                f"budget, so its functions are not run until a probe (every {self._probe_s:g} "
                "s) succeeds",
                reason="function_degraded",
            )
        self._resting_until = None  # this call is the probe

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

    def _start(self, work: Callable[[], T]) -> tuple[concurrent.futures.Future[T], int | None]:
        """``work`` started in a fresh daemon thread: its outcome and the thread's ident.

        Raises:
            FunctionError: ``function_stuck``: an earlier call past its budget still runs.
        """
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
        return done, thread.ident

    def _timed_out(self, done: concurrent.futures.Future[Any], budget_s: float) -> FunctionError:
        """The error of a call past ``budget_s``; a call still running is kept as the runaway."""
        self._runaway = None if done.done() else done
        return FunctionError(
            f"the pipeline's functions ran past their budget of {round(budget_s * 1000)} ms",
            reason="function_timeout",
        )


class FunctionGuard(_Watchdog):
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
        super().__init__(budget_s, degrade_after, monotonic, probe_s)
        self._lock: asyncio.Lock | None = None

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
            self._succeeded()
            return result

    async def _run(self, work: Callable[[], T]) -> T:
        done, ident = self._start(work)
        waiter = asyncio.wrap_future(done)
        try:
            # shield: a timeout must not cancel ``done``, which the thread still completes
            return await asyncio.wait_for(asyncio.shield(waiter), self.budget_s)
        except TimeoutError:
            waiter.add_done_callback(ignore_outcome)  # its late outcome is of no interest
            if not done.done() and ident is not None:
                _interrupt(ident)
                # A moment for Python code to take the interrupt and end: then the next
                # batch gets a fresh thread instead of ``function_stuck``.
                with contextlib.suppress(TimeoutError, FunctionError):
                    await asyncio.wait_for(asyncio.shield(waiter), INTERRUPT_GRACE_S)
            raise self._timed_out(done, self.budget_s) from None


class CallGuard(_Watchdog):
    """Runs a pipeline's user calls in a combiner (UDAF ``merge``/``finalize``) within budgets.

    The combiner's core is synchronous, so the caller blocks, but for at most the call's
    budget: the call runs in a fresh daemon thread, and past the budget it is interrupted
    (``FunctionInterrupted``) and abandoned. As in ``FunctionGuard``: a call blocked in C
    keeps its thread, and until it returns every later call fails at once
    (``function_stuck``); after ``degrade_after`` calls that cost time, calls fail at once
    (``function_degraded``) for ``probe_s`` before one probes. So a function that hangs
    costs the combiner (and every pipeline it hosts) one budget, then one per ``probe_s``
    at most while it stays stuck.

    ``take_failures`` hands the failures since the last look to the runtime, which
    dead-letters them.
    """

    def __init__(
        self,
        budget_s: float,
        degrade_after: int,
        monotonic: Callable[[], float],
        probe_s: float = PROBE_S,
    ) -> None:
        super().__init__(budget_s, degrade_after, monotonic, probe_s)
        self._lock = threading.Lock()  # one call at a time, whichever thread asks
        self._unreported: dict[str, tuple[FunctionError, int]] = {}

    def call(self, work: Callable[[], T], budget_s: float | None = None) -> T:
        """``work()`` in a thread within ``budget_s`` (default ``budget_s`` of the guard).

        Raises:
            FunctionError: as ``FunctionGuard.run``.
        """
        budget = self.budget_s if budget_s is None else budget_s
        with self._lock:
            try:
                self._check_resting()
                result = self._call(work, budget)
            except FunctionError as exc:
                self._failed(exc)
                _, count = self._unreported.get(exc.reason, (exc, 0))
                self._unreported[exc.reason] = (exc, count + 1)
                raise
            self._succeeded()
            return result

    def take_failures(self) -> list[tuple[FunctionError, int]]:
        """Per reason, the last failure since the last look and how many there were."""
        with self._lock:
            taken, self._unreported = list(self._unreported.values()), {}
        return taken

    def _call(self, work: Callable[[], T], budget_s: float) -> T:
        done, ident = self._start(work)
        try:
            return done.result(timeout=budget_s)
        except TimeoutError:
            if not done.done() and ident is not None:
                _interrupt(ident)
                with contextlib.suppress(TimeoutError, FunctionError):
                    done.result(timeout=INTERRUPT_GRACE_S)
            raise self._timed_out(done, budget_s) from None


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
