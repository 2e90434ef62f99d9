"""From what a pipeline publishes (a monitor snapshot) to the ``Signals`` a policy decides on."""

from __future__ import annotations

import statistics
from typing import Any

from shoal.scaler.monitor import Snapshot
from shoal.scaler.policy import Signals


def signals_from(snapshot: Snapshot, now_s: float, workers: int) -> Signals:
    """Policy inputs at ``now_s`` given ``workers`` live (not draining) workers.

    Capacity is the median over live workers of measurements per busy second; the batch
    rate is what the workers report handling (what the research's request-rate rule counts).
    """
    live = [m for m in snapshot.worker_metrics.values() if m.get("state", "running") == "running"]
    capacities = [float(c) for m in live if (c := m.get("capacity_rows_per_s"))]
    return Signals(
        now_s=now_s,
        workers=workers,
        arrival_rows_per_s=snapshot.rows_in_per_s,
        batches_per_s=sum(_number(m, "batches_per_s") for m in live),
        backlog_rows=snapshot.lag_rows,
        oldest_lag_s=None
        if snapshot.oldest_unconfirmed_age_ms is None
        else snapshot.oldest_unconfirmed_age_ms / 1000.0,
        capacity_rows_per_s=statistics.median(capacities) if capacities else None,
        worker_cpu_percent=tuple(_number(m, "cpu_percent") for m in live),
    )


def _number(body: dict[str, Any], key: str) -> float:
    value = body.get(key)
    return float(value) if isinstance(value, int | float) else 0.0
