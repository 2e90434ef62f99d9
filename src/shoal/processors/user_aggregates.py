"""A user aggregate (UDAF, ``shoal.rules.functions``) as an entry of the aggregate registry.

Its declared state fields become ``StateField`` columns named ``<udaf>__<field>``, computed
by kernels that call the user's ``update`` (workers, per batch) and ``merge`` (combiners);
its ``finalize`` is called on the merged columns before the results' columns are selected
(``Aggregate.finalize_eager``; a polars expression form exists too). So a user aggregate travels
in partials and checkpoints and merges across workers exactly like a built-in one.

Where each call runs and what a failure does:

- ``update`` runs in the worker, inside the pipeline's guarded batch (``rules.guard``), and
  so does ``merge`` where the worker merges hopping windows' panes: a ``FunctionError``
  there dead-letters the batch.
- ``merge`` and ``finalize`` run in the combiner, each call under the pipeline's
  ``CallGuard`` (``budget_user_aggregates``: the function's ``budget_ms`` per call). They
  were checked at deploy on sample data (the mergeability laws of
  ``rules.functions.check_udaf``); if one still fails at run time (raises, returns garbage,
  runs past its budget, or is refused while an earlier call is stuck), the affected state
  becomes NaN (so its windows' results are null), and the failure is logged, counted in
  ``ERRORS`` and in the guard's health (the combiner's heartbeat ``functions``, ``degraded``)
  and dead-lettered by the runtime: a combiner never stops, nor waits past a budget, for a
  user function.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import FunctionError
from shoal.processors._kernels import Runs
from shoal.processors.aggregates import Aggregate, StateField
from shoal.rules.functions import STATE_KINDS, Udaf, in_guarded_batch
from shoal.rules.guard import CallGuard

log = logging.getLogger(__name__)

ERRORS: Final[Counter[str]] = Counter()
"""Failures of user ``merge``/``finalize`` in this process, by function name."""


def budget_user_aggregates(
    udafs: Iterable[Udaf], degrade_after: int, monotonic: Callable[[], float]
) -> CallGuard | None:
    """One guard for a pipeline's UDAFs' combiner calls (None: it has none).

    The spec's functions may already have one (another partition of the pipeline in this
    process, or an earlier core of the same spec): then that one, so that one stuck call
    is known to all of them.
    """
    mine = list(udafs)
    if not mine:
        return None
    guard = next((u.budget for u in mine if isinstance(u.budget, CallGuard)), None)
    if guard is None:
        guard = CallGuard(max(u.spec.budget_ms for u in mine) / 1000.0, degrade_after, monotonic)
    for udaf in mine:
        udaf.budget = guard
    return guard


def user_aggregate(udaf: Udaf) -> Aggregate:
    """The registry entry of ``udaf``: its state fields, finaliser and reference."""
    names = list(udaf.state)
    fields: list[StateField] = []
    for i, name in enumerate(names):
        kind: Literal["int", "float"] = "int" if udaf.state[name] == "int" else "float"
        column = udaf.column(name)
        last = i == len(names) - 1
        placeholder = pl.lit(None, dtype=STATE_KINDS[udaf.state[name]])
        fields.append(
            StateField(
                column,
                kind,
                partial=placeholder,  # no polars form: the user's update is the definition
                merge=placeholder,
                partial_np=_kernel(udaf, column, merging=False, last=last),
                merge_np=_kernel(udaf, column, merging=True, last=last),
            )
        )
    columns = [udaf.column(n) for n in names]
    finalize = (
        pl.struct(columns)
        .map_batches(lambda s: _finalize(udaf, s), return_dtype=pl.Float64, is_elementwise=True)
        .alias(udaf.spec.name)
    )
    reference = (
        pl.struct("ts", "value")
        .map_batches(lambda s: _reference(udaf, s), return_dtype=pl.Float64, returns_scalar=True)
        .alias(udaf.spec.name)
    )
    return Aggregate(
        udaf.spec.name,
        tuple(fields),
        finalize,
        reference,
        exact=False,
        finalize_eager=lambda frame: _finalize_states(udaf, frame.select(columns)),
    )


def _kernel(udaf: Udaf, column: str, *, merging: bool, last: bool) -> Any:
    def kernel(runs: Runs) -> npt.NDArray[Any]:
        try:
            values = udaf.fields_of(runs, merging=merging)[column]
        except FunctionError as exc:
            if not merging or in_guarded_batch():
                raise  # in a worker (update, or merging hopping panes): the batch fails
            values = _poisoned(udaf, column, len(runs.starts), exc)
        if last:
            udaf.forget()
        return values

    return kernel


def _poisoned(udaf: Udaf, column: str, groups: int, exc: FunctionError) -> npt.NDArray[Any]:
    ERRORS[udaf.spec.name] += 1
    log.warning("user aggregate %s: merge failed, its state becomes NaN: %s", udaf.spec.name, exc)
    field = column.removeprefix(f"{udaf.spec.name}__")
    if udaf.state[field] == "int":
        return np.zeros(groups, dtype=np.int64)
    return np.full(groups, np.nan)


def _finalize(udaf: Udaf, struct: pl.Series) -> pl.Series:
    return _finalize_states(udaf, struct.struct.unnest())


def _finalize_states(udaf: Udaf, states: pl.DataFrame) -> pl.Series:
    """The results of merged state rows (columns in ``udaf.state`` order), null if it fails."""
    states.columns = list(udaf.state)
    try:
        # NaN (undefined, or state a failed merge poisoned) is published as null, as the
        # built-in aggregates publish an undefined result.
        return udaf.finalize(states).fill_nan(None)
    except FunctionError as exc:
        ERRORS[udaf.spec.name] += 1
        log.warning("user aggregate %s: finalize failed, results null: %s", udaf.spec.name, exc)
        return pl.Series(udaf.spec.name, [None] * states.height, dtype=pl.Float64)


def _reference(udaf: Udaf, struct: pl.Series) -> pl.Series:
    """One group's raw rows → its result: ``finalize(update(rows))`` (the tests' oracle)."""
    rows = struct.struct.unnest()
    groups = np.zeros(rows.height, dtype=np.int64)
    state = udaf.update(groups, rows.get_column("ts"), rows.get_column("value"), 1)
    return udaf.finalize(state)
