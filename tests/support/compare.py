"""Compare emitted results with the oracle, with the tolerances the docs promise."""

from __future__ import annotations

import math

import polars as pl

from shoal.processors.aggregates import AGGREGATES
from shoal.processors.spec import PipelineSpec

EXACT = ("rows", "batches", *(name for name, entry in AGGREGATES.items() if entry.exact))


def assert_matches_oracle(
    emitted: pl.DataFrame,
    expected: pl.DataFrame,
    spec: PipelineSpec,
    scale: pl.DataFrame,
    *,
    skip: tuple[str, ...] = (),
) -> None:
    """Every expected (window, start, key) is emitted once with matching values, and nothing else.

    ``scale`` holds ``window``, ``start``, ``key`` and ``abs_sum`` (sum of |value|) per group,
    the yardstick for float tolerances (sums of mixed-sign values can cancel).
    """
    keys = ["window", "start", "key"]
    users = {a.name for a in spec.aggregates if a.user is not None}
    dupes = emitted.group_by(keys).len().filter(pl.col("len") > 1)
    assert dupes.height == 0, f"emitted more than once:\n{dupes}"
    missing = expected.join(emitted, on=keys, how="anti")
    assert missing.height == 0, f"expected but not emitted:\n{missing}"
    extra = emitted.join(expected, on=keys, how="anti")
    assert extra.height == 0, f"emitted but not expected:\n{extra}"
    joined = expected.join(emitted, on=keys, suffix="_got").join(scale, on=keys, how="left")
    for row in joined.iter_rows(named=True):
        where = f"{row['window']} start={row['start']} key={row['key']}"
        n = row["rows"]
        abs_sum = row["abs_sum"] or 0.0
        for name in ("rows", "batches", *spec.aggregate_names):
            if name in skip:
                continue
            want, got = row[name], row[f"{name}_got"]
            if name in EXACT:
                assert got == want, f"{where}: {name} {got!r} != {want!r}"
            elif name == "sum":
                assert math.isclose(got, want, rel_tol=0, abs_tol=1e-9 * max(abs_sum, 1e-300)), (
                    f"{where}: sum {got!r} != {want!r}"
                )
            elif name == "mean":
                tol = 1e-9 * max(abs_sum / n, 1e-300)
                assert math.isclose(got, want, rel_tol=0, abs_tol=tol), (
                    f"{where}: mean {got} != {want}"
                )
            elif name in AGGREGATES or name in users:  # stddev, a UDAF: float arithmetic
                if want is None:
                    assert got is None, f"{where}: {name} {got} != None"
                else:
                    tol = 1e-7 * max(abs(want), abs_sum / n, 1e-300)
                    assert math.isclose(got, want, rel_tol=0, abs_tol=tol), (
                        f"{where}: {name} {got} != {want}"
                    )
            else:  # a quantile from the sketch
                bound = spec.sketch_accuracy * abs(want) * (1 + 1e-9) + 1e-9
                assert abs(got - want) <= bound, f"{where}: {name} {got} vs exact {want}"


def scale_of(rows: pl.DataFrame, spec: PipelineSpec) -> pl.DataFrame:
    """Per (window, start, key) sum of |value| over on-time rows, for tolerances."""
    from tests.support.oracle import late_flags  # noqa: PLC0415

    return (
        late_flags(rows, spec)
        .filter(~pl.col("late"))
        .group_by("window", "start", "key")
        .agg(abs_sum=pl.col("value").abs().sum())
    )


def dedupe_identical(windows: list[dict]) -> pl.DataFrame:
    """Window messages as result rows, each identity once; a re-published window (after a
    restart or a takeover) must equal the first publication, or the assertion fails."""
    by_identity: dict[tuple, dict] = {}
    for message in windows:
        identity = (message["window"], message["start"], message["partition"], message["revision"])
        previous = by_identity.get(identity)
        if previous is not None:
            assert _same(previous["results"], message["results"]), (
                f"re-published window differs: {identity}"
            )
        by_identity[identity] = message
    rows = [
        {"window": m["window"], "start": m["start"], "end": m["end"], **r}
        for m in by_identity.values()
        for r in m["results"]
    ]
    return pl.DataFrame(rows, infer_schema_length=None)


def dedupe_count_windows(windows: list[dict]) -> pl.DataFrame:
    """Count-window messages as result rows, each (window, key, index) once; a window
    published again (after a restart) must have the same values, or the assertion fails.

    By window identity, not message identity: a restored combiner that gave up re-taking
    its logged closes may publish a window in a step of another span (``start``/``end``).
    """
    by_identity: dict[tuple, dict] = {}
    for message in windows:
        for result in message["results"]:
            identity = (message["window"], result["key"], result["index"])
            previous = by_identity.get(identity)
            if previous is not None:
                assert _same([previous["result"]], [result]), f"window differs: {identity}"
            by_identity[identity] = {"message": message, "result": result}
    rows = [
        {
            "window": m["message"]["window"],
            "start": m["message"]["start"],
            "end": m["message"]["end"],
            **m["result"],
        }
        for m in by_identity.values()
    ]
    return pl.DataFrame(rows, infer_schema_length=None)


def _same(a: list[dict], b: list[dict]) -> bool:
    key = lambda r: r["key"]  # noqa: E731
    a, b = sorted(a, key=key), sorted(b, key=key)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        for field in x:
            if isinstance(x[field], float) and isinstance(y[field], float):
                if abs(x[field] - y[field]) > 1e-9 * max(1.0, abs(x[field])):
                    return False
            elif x[field] != y[field]:
                return False
    return True


def assert_count_windows_match(
    emitted: pl.DataFrame,
    expected: pl.DataFrame,
    spec: PipelineSpec,
    scale: pl.DataFrame,
    skip: tuple[str, ...] = (),
) -> None:
    """``assert_matches_oracle`` for count windows: identified by (window, index, key).

    ``expected`` and ``scale`` from ``oracle.expected_count_results``; also checks each
    window's first and last row time.
    """
    as_start = {"index": "start"}
    got = emitted.drop("start", "end").rename(as_start)
    want = expected.rename(as_start)
    assert_matches_oracle(got, want, spec, scale.rename(as_start), skip=skip)
    keys = ["window", "start", "key"]
    times = want.join(got, on=keys, suffix="_got").filter(
        (pl.col("first_ts") != pl.col("first_ts_got"))
        | (pl.col("last_ts") != pl.col("last_ts_got"))
    )
    assert times.height == 0, f"first/last row times differ:\n{times}"
