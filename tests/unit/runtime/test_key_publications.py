"""Per-key publications under way skip the keys a newer queued result has (conflation)."""

from __future__ import annotations

import polars as pl

from shoal.processors.results import WindowResult
from shoal.runtime.combiner import _KeyPublications, _KeyRun
from shoal.schemas.results import RETRACTED


def result(
    start: int, keys: list[str | None], *, retracted: list[bool] | None = None
) -> WindowResult:
    frame = pl.DataFrame({"key": keys, "count": list(range(len(keys)))})
    if retracted is not None:
        frame = frame.with_columns(
            pl.Series(RETRACTED, [True if r else None for r in retracted], dtype=pl.Boolean)
        )
    return WindowResult("w", start, start + 1_000, frame)


def kept_keys(pubs: _KeyPublications, run: _KeyRun, res: WindowResult) -> list[str | None]:
    keep = pubs.kept(run, res.frame)
    keys = res.frame["key"].to_list()
    return keys if keep is None else [k for k, k_ok in zip(keys, keep, strict=True) if k_ok]


def test_a_run_keeps_the_keys_no_later_result_has() -> None:
    pubs = _KeyPublications()
    first, second, third = (
        result(0, ["a", "b", "c", None]),
        result(1, ["b"]),
        result(2, ["c", None]),
    )
    r1 = pubs.start(first)
    assert kept_keys(pubs, r1, first) == ["a", "b", "c", None]  # nothing queued after it
    r2 = pubs.start(second)
    r3 = pubs.start(third)
    assert kept_keys(pubs, r1, first) == ["a"]  # b by the second, c and the null key by the third
    assert kept_keys(pubs, r2, second) == ["b"]
    assert kept_keys(pubs, r3, third) == ["c", None]


def test_a_result_queued_after_all_runs_finished_supersedes_nothing_before_it() -> None:
    pubs = _KeyPublications()
    old = result(0, ["a", "b"])
    pubs.finished(pubs.start(old))
    assert pubs.latest == {}  # nothing under way: nothing kept
    new = result(1, ["a"])
    r_new = pubs.start(new)
    r_next = pubs.start(result(2, ["b"]))
    assert kept_keys(pubs, r_new, new) == ["a"]
    pubs.finished(r_new)
    pubs.finished(r_next)
    assert not pubs.running


def test_retracted_rows_do_not_supersede_and_finished_runs_still_count() -> None:
    pubs = _KeyPublications()
    first = result(0, ["a", "b"])
    r1 = pubs.start(first)
    r2 = pubs.start(result(1, ["a", "b"], retracted=[True, False]))  # a retracted: no value
    pubs.finished(r2)  # the newer publication is done: its keys still supersede r1's
    assert kept_keys(pubs, r1, first) == ["a"]
