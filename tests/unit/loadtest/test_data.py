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


def reference_rows(sensors: SensorField, until_ms: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (ts, sensor code) before ``until_ms``, one measurement at a time, sorted."""
    rows = []
    for j in range(sensors.sensors):
        phase, code = sensors._phase_ms[j], int(sensors._codes[j])
        k = 0
        while (t := int(np.floor(sensors.start_ms + k * sensors.period_ms + phase))) < until_ms:
            rows.append((t, j, code))
            k += 1
    rows.sort(key=lambda r: (r[0], r[1]))
    return np.array([r[0] for r in rows]), np.array([r[2] for r in rows])


@pytest.mark.parametrize(
    "steps", [[2_000], [7, 333, 334, 1_000, 1_999, 2_000], [*range(1, 2_000, 37), 2_000]]
)
def test_take_yields_every_measurement_once_in_time_order_however_it_is_called(
    steps: list[int],
) -> None:
    ref = SensorField("gw", sensors=37, rate_hz=33.0, start_ms=T0 + 5, seed=11)
    want_ts, want_codes = reference_rows(ref, T0 + 2_000)
    sensors = SensorField("gw", sensors=37, rate_hz=33.0, start_ms=T0 + 5, seed=11)
    taken = [sensors.take(T0 + step) for step in steps]
    ts = np.concatenate([b.ts for b in taken])
    codes = np.concatenate([b.sensor_id.codes for b in taken])
    values = np.concatenate([b.value for b in taken])
    assert (ts == want_ts).all()
    assert (codes == want_codes).all()
    assert (np.diff(ts) >= 0).all()
    units = values / sensors.resolution
    assert np.abs(units - np.rint(units)).max() < 1e-6  # multiples of the resolution
    # a sensor's level (15..35) plus its drift (+-2) plus the pool's noise (sd 0.5)
    assert values.min() > 10.0
    assert values.max() < 40.0
    assert 0.3 < float(np.std(values - sensors._level[np.argsort(sensors._codes)][codes])) < 2.5


def test_the_same_seed_gives_the_same_values() -> None:
    a = SensorField("gw", sensors=20, rate_hz=10.0, start_ms=T0, seed=4).take(T0 + 5_000)
    b = SensorField("gw", sensors=20, rate_hz=10.0, start_ms=T0, seed=4).take(T0 + 5_000)
    c = SensorField("gw", sensors=20, rate_hz=10.0, start_ms=T0, seed=5).take(T0 + 5_000)
    assert (a.value == b.value).all()
    assert (a.ts == b.ts).all()
    assert not (a.value == c.value).all()


def test_a_take_longer_than_half_the_noise_pool_wraps_around_it() -> None:
    sensors = SensorField("gw", sensors=1_000, rate_hz=100.0, start_ms=T0, seed=2)
    block = sensors.take(T0 + 2_000)  # 200,000 rows, more than the pool holds
    assert len(block) == 200_000
    pool = sensors._noise
    run = sensors._noise_run(len(pool) + 10)
    start = int(np.flatnonzero(pool == run[0])[0])
    assert (run == pool[(start + np.arange(len(run))) % len(pool)]).all()  # read cyclically
