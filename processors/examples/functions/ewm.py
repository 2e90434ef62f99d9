"""An exponentially weighted mean over event time, as a mergeable user aggregate (UDAF).

Each row weighs 2 ** ((ts - latest) / HALF_LIFE_MS): the latest row of the window counts 1,
a row one half-life older 1/2. The state is (latest event time, weighted sum, sum of
weights) relative to that latest time; two states merge by rescaling both to the later
time, so partial states from any workers and any batch split give the same mean.
"""

from typing import ClassVar

import polars as pl

HALF_LIFE_MS = 10_000.0
# The state of no rows: no time yet (far in the past: it rescales to weight 0), nothing summed.
EMPTY_TS = -(2**62)


class Ewm:
    """The aggregate: state fields and the four calls every mergeable aggregate has."""

    state: ClassVar[dict[str, str]] = {"t": "int", "num": "float", "den": "float"}

    def init(self) -> dict[str, float]:
        """The state of no rows."""
        return {"t": EMPTY_TS, "num": 0.0, "den": 0.0}

    def update(self, rows: pl.DataFrame) -> pl.DataFrame:
        """One batch's rows to one state row per group.

        ``rows`` has group, ts and value; groups are (window, key) pairs numbered 0..n-1.
        """
        weight = 2.0 ** ((pl.col("ts") - pl.col("ts").max().over("group")) / HALF_LIFE_MS)
        return rows.group_by("group").agg(
            t=pl.col("ts").max(),
            num=(weight * pl.col("value")).sum(),
            den=weight.sum(),
        )

    def merge(self, states: pl.DataFrame) -> pl.DataFrame:
        """State rows (group, t, num, den; several per group) to one per group."""
        scale = 2.0 ** ((pl.col("t") - pl.col("t").max().over("group")) / HALF_LIFE_MS)
        return states.group_by("group").agg(
            t=pl.col("t").max(),
            num=(scale * pl.col("num")).sum(),
            den=(scale * pl.col("den")).sum(),
        )

    def finalize(self, states: pl.DataFrame) -> pl.Series:
        """Merged state rows to the mean, one per row."""
        return states["num"] / states["den"]
