"""Synthetic data: a share of late measurements, chosen the same way for the same seed."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.errors import ConfigError
from shoal.loadtest.data import LateShare, SensorField

T0 = 1_700_000_000_000


def blocks(until: list[int]) -> list[np.ndarray]:
    sensors = SensorField("gw", sensors=50, rate_hz=20.0, start_ms=T0, seed=3)
    return [sensors.take(t).ts for t in until]


def late_flags(share: LateShare, until: list[int]) -> np.ndarray:
    sensors = SensorField("gw", sensors=50, rate_hz=20.0, start_ms=T0, seed=3)
    flags = []
    for t in until:
        block = sensors.take(t)
        flags.append(share.apply(block).ts != block.ts)
    return np.concatenate(flags)


def test_the_share_of_late_rows_moves_back_by_the_given_time() -> None:
    sensors = SensorField("gw", sensors=100, rate_hz=50.0, start_ms=T0, seed=1)
    share = LateShare(0.1, by_ms=60_000, seed=7)
    block = sensors.take(T0 + 10_000)  # 50,000 rows
    out = share.apply(block)
    moved = out.ts != block.ts
    assert share.made_late == int(moved.sum())
    assert share.made_late == pytest.approx(0.1 * len(block), rel=0.05)
    assert (block.ts[moved] - out.ts[moved] == 60_000).all()
    assert (out.value == block.value).all()
    assert (out.sensor_id.codes == block.sensor_id.codes).all()


def test_the_same_seed_makes_the_same_rows_late_whatever_the_blocks() -> None:
    fine = [T0 + t for t in range(100, 5_001, 100)]
    coarse = [T0 + 2_500, T0 + 5_000]
    a = late_flags(LateShare(0.2, 1_000, seed=5), fine)
    b = late_flags(LateShare(0.2, 1_000, seed=5), coarse)
    c = late_flags(LateShare(0.2, 1_000, seed=6), coarse)
    assert len(a) == len(b) == sum(len(ts) for ts in blocks(coarse))
    assert (a == b).all()
    assert not (b == c).all()


def test_no_share_leaves_blocks_alone_and_bad_settings_are_refused() -> None:
    sensors = SensorField("gw", sensors=10, rate_hz=10.0, start_ms=T0)
    block = sensors.take(T0 + 1_000)
    share = LateShare(0.0, 1_000)
    assert share.apply(block) is block
    assert share.made_late == 0
    with pytest.raises(ConfigError):
        LateShare(1.5, 1_000)
    with pytest.raises(ConfigError):
        LateShare(0.5, 0)
