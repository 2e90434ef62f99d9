"""The alert state machine: for, resolve, one transition per change, corrections, restarts."""

from __future__ import annotations

import polars as pl
import pytest

from shoal.errors import ConfigError
from shoal.rules import AlertBook, AlertSpec

COLUMNS = {"max": pl.Float64(), "count": pl.Int64()}


def alert(condition: str = "max > 30", *, for_windows: int = 1, resolve: str | None = None):
    return AlertSpec.build(
        "hot",
        condition,
        for_windows=for_windows,
        resolve=resolve,
        window="w",
        columns=COLUMNS,
    )


def window(start: int, maxima: dict[str | None, float | None], name: str = "w") -> pl.DataFrame:
    keys = list(maxima)
    return pl.DataFrame(
        {
            "window": [name] * len(keys),
            "start": [start] * len(keys),
            "end": [start + 10] * len(keys),
            "key": keys,
            "rows": [1] * len(keys),
            "batches": [1] * len(keys),
            "max": [maxima[k] for k in keys],
        },
        schema={
            "window": pl.String,
            "start": pl.Int64,
            "end": pl.Int64,
            "key": pl.String,
            "rows": pl.Int64,
            "batches": pl.Int64,
            "max": pl.Float64,
        },
    )


def states(book: AlertBook, frame: pl.DataFrame) -> list[tuple[str | None, int, str]]:
    return [(t.key, t.start, t.state) for t in book.evaluate(frame)]


def test_fires_after_for_consecutive_results_and_resolves_once() -> None:
    book = AlertBook((alert(for_windows=2),))
    assert states(book, window(0, {"a": 31.0, "b": 10.0})) == []
    assert states(book, window(10, {"a": 35.0, "b": 40.0})) == [("a", 10, "firing")]
    assert states(book, window(20, {"a": 36.0, "b": 20.0})) == []  # still firing: no repeat
    assert states(book, window(30, {"a": 20.0, "b": 41.0})) == [("a", 30, "resolved")]
    assert states(book, window(40, {"a": 20.0, "b": 42.0})) == [("b", 40, "firing")]
    assert book.firing("hot") == ["b"]


def test_a_result_that_does_not_meet_the_condition_restarts_the_count() -> None:
    book = AlertBook((alert(for_windows=2),))
    for start, value in ((0, 31.0), (10, 29.0), (20, 31.0)):
        assert states(book, window(start, {"a": value})) == []
    assert states(book, window(30, {"a": 31.0})) == [("a", 30, "firing")]


def test_a_window_without_the_key_neither_breaks_nor_resolves() -> None:
    book = AlertBook((alert(for_windows=2),))
    states(book, window(0, {"a": 31.0}))
    assert states(book, window(10, {"b": 1.0})) == []
    assert states(book, window(20, {"a": 31.0})) == [("a", 20, "firing")]
    assert states(book, window(30, {"b": 1.0})) == []
    assert book.firing("hot") == ["a"]


def test_explicit_resolve_leaves_a_dead_band() -> None:
    book = AlertBook((alert(resolve="max < 20"),))
    assert states(book, window(0, {"a": 31.0})) == [("a", 0, "firing")]
    assert states(book, window(10, {"a": 25.0})) == []  # not above 30, not below 20
    assert states(book, window(20, {"a": 19.0})) == [("a", 20, "resolved")]


def test_null_never_meets_a_condition() -> None:
    book = AlertBook((alert(),))
    assert states(book, window(0, {"a": None})) == []
    states(book, window(10, {"a": 31.0}))
    assert states(book, window(20, {"a": None})) == []  # NOT (null > 30) is null: stays firing


def test_a_correction_of_an_evaluated_window_makes_no_transition() -> None:
    book = AlertBook((alert(),))
    assert states(book, window(0, {"a": 31.0})) == [("a", 0, "firing")]
    assert states(book, window(0, {"a": 10.0})) == []  # revision 2 of the same window
    assert states(book, window(0, {"b": 99.0})) == []  # a key new in the revision, too
    assert book.firing("hot") == ["a"]


def test_other_windows_are_not_watched() -> None:
    book = AlertBook((alert(),))
    assert states(book, window(0, {"a": 31.0}, name="other")) == []


def test_restart_from_a_snapshot_does_not_fire_again() -> None:
    book = AlertBook((alert(for_windows=2),))
    states(book, window(0, {"a": 31.0, "b": 31.0}))
    states(book, window(10, {"a": 31.0}))
    saved = book.snapshot()
    after = states(book, window(20, {"a": 10.0, "b": 31.0}))
    restored = AlertBook((alert(for_windows=2),))
    restored.restore(saved)
    # The window closed after the snapshot is published again: the same transitions.
    assert states(restored, window(20, {"a": 10.0, "b": 31.0})) == after
    assert after == [("a", 20, "resolved"), ("b", 20, "firing")]
    # Replaying an evaluated window once more is a correction: nothing.
    assert states(restored, window(10, {"a": 31.0})) == []


def test_transitions_carry_the_window_values() -> None:
    book = AlertBook((alert(),))
    (t,) = book.evaluate(window(0, {None: 31.5}))
    assert (t.key, t.window, t.end, t.streak) == (None, "w", 10, 1)
    assert t.values == {"rows": 1, "batches": 1, "max": 31.5}


def test_conditions_are_checked_when_built() -> None:
    with pytest.raises(ConfigError) as caught:
        alert("p95 > 3")
    assert (caught.value.field, caught.value.reason) == ("condition", "unknown_column")
    with pytest.raises(ConfigError) as caught:
        alert(resolve="max")
    assert (caught.value.field, caught.value.reason) == ("resolve", "wrong_type")


def test_several_windows_in_one_step_are_taken_in_order() -> None:
    """A close step may hold several windows: a miss between two hits restarts the count."""
    book = AlertBook((alert(for_windows=2),))
    frames = pl.concat([window(0, {"a": 31.0}), window(10, {"a": 1.0}), window(20, {"a": 31.0})])
    assert states(book, frames) == []
    assert states(book, window(30, {"a": 31.0})) == [("a", 30, "firing")]


def test_the_null_key_is_tracked_like_any_other() -> None:
    book = AlertBook((alert(for_windows=2),))
    frames = pl.concat([window(0, {None: 31.0}), window(10, {None: 31.0})])
    assert states(book, frames) == [(None, 10, "firing")]
    assert states(book, window(20, {None: 1.0})) == [(None, 20, "resolved")]
