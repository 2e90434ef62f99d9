"""Alerts: named conditions over a window's results per key, as a state machine.

An alert is ``condition`` (SQL over a result row: ``p95 > 80``), ``for`` (how many of the
key's consecutive results must meet it before it fires) and ``resolve`` (when a firing alert
resolves; default ``NOT (condition)``, where a null answer counts as not met). Each (alert,
key) is ``ok`` or ``firing``; only the *transitions* leave this module, each exactly once:

- ``ok`` → ``firing`` at the window that makes ``for`` consecutive results meeting the
  condition (a result that does not meet it starts the count again);
- ``firing`` → ``resolved`` (then ``ok``) at the first later result meeting ``resolve``.

"Consecutive" means the key's consecutive results in the alert's window: a window in which
the key has no rows has no result and neither extends nor breaks a streak (no data is no
evidence either way).

Windows are evaluated once, at their first result, in start order: ``evaluated_through``
is the latest start seen, and a result whose start is not beyond it is a correction
(allowed lateness) and is not evaluated again. So a correction never makes or undoes a
transition, and a replayed close after a restart from a snapshot (taken with this state)
reproduces the same transitions with the same identity (alert, key, window start, state).
Pure: no clock, no I/O; the combiner keeps ``snapshot()`` in its checkpoint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson
import polars as pl

from shoal.errors import SchemaError
from shoal.rules.expressions import compile_having

AlertState = Literal["firing", "resolved"]
MAX_FOR: Final = 10_000


@dataclass(frozen=True, slots=True)
class AlertSpec:
    """One ``[[alerts]]`` table of a pipeline spec, compiled.

    Attributes:
        name: the alert (a topic segment).
        condition: SQL over a result row's columns (aggregates by output name, ``rows``).
        for_windows: consecutive results meeting ``condition`` before it fires (>= 1).
        resolve: SQL condition that resolves a firing alert (None: ``NOT (condition)``).
        window: the window spec it watches (by name).
    """

    name: str
    condition: str
    for_windows: int
    resolve: str | None
    window: str
    _condition: pl.Expr = field(compare=False, repr=False)
    _resolve: pl.Expr = field(compare=False, repr=False)

    @classmethod
    def build(
        cls,
        name: str,
        condition: str,
        *,
        for_windows: int,
        resolve: str | None,
        window: str,
        columns: dict[str, pl.DataType],
    ) -> AlertSpec:
        """Compile and check both conditions against the result columns.

        Raises:
            ConfigError: ``field`` ``condition`` or ``resolve``, as ``compile_having``.
        """
        cond = compile_having(condition, columns, field="condition")
        res = (
            compile_having(resolve, columns, field="resolve")
            if resolve is not None
            else compile_having(f"NOT ({condition})", columns, field="condition")
        )
        return cls(name, condition, for_windows, resolve, window, cond.expr, res.expr)

    @property
    def identity(self) -> str:
        """A short hash of the definition (in every transition: which rule decided)."""
        text = repr((self.name, self.condition, self.for_windows, self.resolve, self.window))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change of one (alert, key), at one window.

    Attributes:
        alert: the alert's name.
        key: the result key.
        state: ``firing`` or ``resolved``.
        window: the window spec's name.
        start: the window's start (with ``alert``, ``key`` and ``state``: the identity).
        end: the window's end.
        values: the result row's columns besides window, start, end and key.
        streak: consecutive results meeting the condition when it fired (0 when resolved).
    """

    alert: str
    key: str | None
    state: AlertState
    window: str
    start: int
    end: int
    values: dict[str, Any]
    streak: int


@dataclass
class _KeyState:
    streak: int = 0
    firing: bool = False


class AlertBook:
    """The running state of one pipeline partition's alerts (see the module docstring)."""

    def __init__(self, alerts: tuple[AlertSpec, ...]) -> None:
        self.alerts = alerts
        self.keys: dict[str, dict[str | None, _KeyState]] = {a.name: {} for a in alerts}
        self.evaluated_through: dict[str, int | None] = {a.name: None for a in alerts}

    def firing(self, alert: str) -> list[str | None]:
        """Keys for which ``alert`` is firing now."""
        return [k for k, s in self.keys[alert].items() if s.firing]

    def evaluate(self, results: pl.DataFrame) -> list[Transition]:
        """Feed closed window results (``ClosedWindows.frame``); the transitions they make."""
        out: list[Transition] = []
        if results.height == 0:
            return out
        for alert in self.alerts:
            mine = results.filter(pl.col("window") == alert.window)
            through = self.evaluated_through[alert.name]
            if through is not None:
                mine = mine.filter(pl.col("start") > through)  # corrections: seen already
            if mine.height == 0:
                continue
            out.extend(self._evaluate(alert, mine.sort("start", "key", nulls_last=True)))
            self.evaluated_through[alert.name] = int(mine["start"].max())  # type: ignore[arg-type]
        return out

    def _evaluate(self, alert: AlertSpec, frame: pl.DataFrame) -> list[Transition]:
        states = self.keys[alert.name]
        flagged = frame.with_columns(
            alert._condition.fill_null(value=False).alias("__met"),
            alert._resolve.fill_null(value=False).alias("__resolves"),
        )
        # Only keys with a streak or an open alert, or meeting the condition in some window
        # of this frame, can change; every result of those keys is needed, in start order.
        met = flagged.filter(pl.col("__met")).get_column("key")
        candidates = pl.concat([pl.Series(list(states), dtype=pl.String), met]).unique()
        relevant = flagged.filter(pl.col("key").is_in(candidates.implode(), nulls_equal=True))
        out: list[Transition] = []
        value_columns = [c for c in frame.columns if c not in {"window", "start", "end", "key"}]
        for row in relevant.iter_rows(named=True):
            key = row["key"]
            state = states.get(key) or _KeyState()
            changed: AlertState | None = None
            if state.firing:
                if row["__resolves"]:
                    state.firing, state.streak, changed = False, 0, "resolved"
            elif row["__met"]:
                state.streak += 1
                if state.streak >= alert.for_windows:
                    state.firing, changed = True, "firing"
            else:
                state.streak = 0
            if changed is not None:
                out.append(
                    Transition(
                        alert=alert.name,
                        key=key,
                        state=changed,
                        window=alert.window,
                        start=int(row["start"]),
                        end=int(row["end"]),
                        values={c: row[c] for c in value_columns},
                        streak=state.streak,
                    )
                )
            if state.firing or state.streak:
                states[key] = state
            else:
                states.pop(key, None)
        return out

    def snapshot(self) -> dict[str, Any]:
        """The state as plain data (for the combiner's checkpoint)."""
        return {
            a.name: {
                "through": self.evaluated_through[a.name],
                "keys": [[k, s.streak, s.firing] for k, s in self.keys[a.name].items()],
            }
            for a in self.alerts
        }

    def restore(self, data: dict[str, Any] | None) -> None:
        """Resume from ``snapshot()``; alerts the snapshot does not know start afresh.

        Raises:
            SchemaError: the data is not a snapshot of this shape.
        """
        for alert in self.alerts:
            self.keys[alert.name] = {}
            self.evaluated_through[alert.name] = None
        for name, entry in (data or {}).items():
            if name not in self.keys:
                continue  # an alert the new spec no longer has
            try:
                self.evaluated_through[name] = entry["through"]
                self.keys[name] = {k: _KeyState(int(n), bool(f)) for k, n, f in entry["keys"]}
            except (KeyError, TypeError, ValueError) as exc:
                raise SchemaError(
                    f"unreadable alert state for {name!r}: {exc}", reason="bad_checkpoint"
                ) from exc


ALERT_VERSION: Final = 1


def alert_payload(
    transition: Transition,
    alert: AlertSpec,
    *,
    pipeline: str,
    partition: int,
    spec: str,
    at_ms: int,
) -> bytes:
    """The JSON message of one transition (schemas/alert.schema.json, CONTRACT §24)."""
    return orjson.dumps(
        {
            "shoal": ALERT_VERSION,
            "pipeline": pipeline,
            "alert": transition.alert,
            "key": transition.key,
            "state": transition.state,
            "window": transition.window,
            "start": transition.start,
            "end": transition.end,
            "values": transition.values,
            "streak": transition.streak,
            "condition": alert.condition,
            "resolve": alert.resolve if alert.resolve is not None else f"NOT ({alert.condition})",
            "for": alert.for_windows,
            "rule": alert.identity,
            "spec": spec,
            "partition": partition,
            "at": at_ms,
        }
    )
