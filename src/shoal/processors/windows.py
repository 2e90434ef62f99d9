"""Window arithmetic: pure functions from timestamps to the windows that contain them.

Windows are aligned to the epoch and half-open: ``[start, start + size)``. A timestamp ``t``
belongs to the hopping windows whose start is ``floor(t / slide) * slide - j * slide`` for
``j`` in ``0 .. size/slide - 1``; a tumbling window is a hopping one with ``slide = size``.
Floor division makes negative timestamps fall into the window *before* zero, like positive ones.
"""

from __future__ import annotations

import polars as pl

from shoal.processors.spec import WindowSpec


def window_start(ts_ms: int, window: WindowSpec) -> int:
    """Start of the latest window containing ``ts_ms`` (the only one, for tumbling)."""
    return (ts_ms // window.slide_ms) * window.slide_ms


def window_starts(ts_ms: int, window: WindowSpec) -> list[int]:
    """Starts of every window containing ``ts_ms``, oldest first."""
    last = window_start(ts_ms, window)
    return [last - j * window.slide_ms for j in reversed(range(window.windows_per_row))]


def window_end(start_ms: int, window: WindowSpec) -> int:
    """Exclusive end of the window starting at ``start_ms``."""
    return start_ms + window.size_ms


def start_expr(window: WindowSpec, ts: str = "ts") -> pl.Expr:
    """Polars expression: start of the latest window containing each row's timestamp."""
    return (pl.col(ts) // window.slide_ms) * window.slide_ms


def with_window_starts(frame: pl.DataFrame, window: WindowSpec, ts: str = "ts") -> pl.DataFrame:
    """``frame`` with a ``start`` column; rows are repeated once per hopping window."""
    last = start_expr(window, ts)
    if window.windows_per_row == 1:
        return frame.with_columns(last.alias("start"))
    starts = pl.concat_list([last - j * window.slide_ms for j in range(window.windows_per_row)])
    return frame.with_columns(starts.alias("start")).explode("start")
