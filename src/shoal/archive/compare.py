"""Compare two sets of window results (live vs replayed): same keys and counts, close values.

Integer columns (``rows``, ``batches``, ``count``) must be equal; float columns must agree
within a relative tolerance (``|a - b| <= rel_tol * max(|a|, |b|)``; nulls must match).
Only windows present in ``reference`` are compared by default: a replay also emits the
windows a live pipeline still held open when the archive ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import polars as pl

from shoal.schemas.results import HEADER_SCHEMA, INTEGER_FIELDS

KEY: Final = ("pipeline", "window", "start", "key")


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of ``compare_results``.

    Attributes:
        windows: (window, start) pairs compared.
        rows: (window, start, key) rows compared.
        missing: rows of ``reference`` absent from ``other``.
        extra: rows of ``other`` absent from ``reference`` within the compared windows.
        mismatched: rows whose integers differ or whose floats differ beyond ``rel_tol``.
        max_rel_diff: the largest relative difference per float column.
        rel_tol: the tolerance used.
        examples: a few mismatched rows, for a message.
    """

    windows: int
    rows: int
    missing: int
    extra: int
    mismatched: int
    max_rel_diff: dict[str, float]
    rel_tol: float
    examples: pl.DataFrame = field(default_factory=pl.DataFrame)

    @property
    def equal(self) -> bool:
        """Same rows, equal integers, floats within tolerance."""
        return self.missing == 0 and self.extra == 0 and self.mismatched == 0

    def __str__(self) -> str:
        verdict = "equal" if self.equal else "DIFFERENT"
        worst = max(self.max_rel_diff.values(), default=0.0)
        return (
            f"{verdict}: {self.windows} windows, {self.rows} rows compared; missing "
            f"{self.missing}, extra {self.extra}, mismatched {self.mismatched}; largest relative "
            f"difference {worst:.3g} (tolerance {self.rel_tol:g})"
        )


def compare_results(
    reference: pl.DataFrame,
    other: pl.DataFrame,
    *,
    rel_tol: float = 1e-9,
    all_windows: bool = False,
) -> Comparison:
    """Compare result-layout frames (see the module docstring).

    Args:
        reference: e.g. the live results (archived or collected).
        other: e.g. the replayed results.
        rel_tol: relative tolerance of float columns.
        all_windows: also count windows that only ``other`` has as extra.
    """
    key = [c for c in KEY if c in reference.columns and c in other.columns]
    if not all_windows:
        windows = reference.select(*key[:-1]).unique()
        other = other.join(windows, on=key[:-1], how="semi")
    values = [
        c
        for c in reference.columns
        if c in other.columns and c not in HEADER_SCHEMA and c not in ("key", "received_at")
    ]
    left = reference.select(*key, *values)
    right = other.select(*key, *values)
    joined = left.join(right, on=key, how="inner", suffix="_other", nulls_equal=True)
    missing = left.join(right, on=key, how="anti", nulls_equal=True).height
    extra = right.join(left, on=key, how="anti", nulls_equal=True).height
    bad = pl.lit(False)
    max_rel: dict[str, float] = {}
    for name in values:
        a, b = pl.col(name), pl.col(f"{name}_other")
        null_mismatch = a.is_null() != b.is_null()
        if name in INTEGER_FIELDS:
            bad = bad | null_mismatch | (a != b).fill_null(False)
            continue
        scale = pl.max_horizontal(a.abs(), b.abs())
        rel = pl.when(scale > 0).then((a - b).abs() / scale).otherwise(0.0)
        worst = joined.select(rel.max()).item()
        max_rel[name] = float(worst) if worst is not None else 0.0
        bad = bad | null_mismatch | (rel > rel_tol).fill_null(False)
    flagged = joined.filter(bad)
    return Comparison(
        windows=joined.select(*key[:-1]).unique().height,
        rows=joined.height,
        missing=missing,
        extra=extra,
        mismatched=flagged.height,
        max_rel_diff=max_rel,
        rel_tol=rel_tol,
        examples=flagged.head(5),
    )
