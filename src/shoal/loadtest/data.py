"""Synthetic sensor data, generated in whole arrays (no per-measurement Python).

Every sensor reports at a fixed rate with its own phase; values follow a slow per-sensor
sine plus noise, quantised to the sensor's resolution (0.001 by default) the way ADC readings
are. The same seed gives the same data, so runs are comparable.

With ``attributes``, every measurement also carries the research's descriptive fields (name,
type, unit): sensor ``i`` is of kind ``KINDS[i % len(KINDS)]``, so pipelines can key on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from shoal.errors import ConfigError
from shoal.schemas import ATTRIBUTE_COLUMNS, DictColumn, Measurements

KINDS: Final = (
    ("air temperature", "temperature", "degC"),
    ("relative humidity", "humidity", "percent"),
    ("fine particles", "pm2_5", "ug/m3"),
    ("coarse particles", "pm10", "ug/m3"),
    ("noise level", "noise", "dBA"),
    ("nitrogen dioxide", "no2", "ug/m3"),
    ("traffic count", "traffic", "vehicles/min"),
    ("water level", "water_level", "cm"),
)
"""(name, type, unit) of the simulated sensor kinds."""


def _kind_codes() -> dict[str, tuple[tuple[str, ...], npt.NDArray[np.uint32]]]:
    """Per attribute column: its distinct values and each kind's code into them."""
    out = {}
    for i, name in enumerate(ATTRIBUTE_COLUMNS):
        words = tuple(sorted({kind[i] for kind in KINDS}))
        out[name] = (words, np.array([words.index(kind[i]) for kind in KINDS], dtype=np.uint32))
    return out


_KIND_CODES: Final = _kind_codes()


def sensor_ids(gateway_id: str, count: int) -> tuple[str, ...]:
    """Sensor ids of one gateway: ``<gateway>-s0000`` ... (unique across gateways)."""
    width = max(4, len(str(count - 1)))
    return tuple(f"{gateway_id}-s{i:0{width}d}" for i in range(count))


_NOISE_POOL: Final = 1 << 17
"""Normal deviates drawn once per field; a call reads a contiguous run of them."""


@dataclass
class SensorField:
    """A gateway's sensors, emitting at ``rate_hz`` each, from ``start_ms`` on.

    ``take(until_ms)`` returns every measurement with ``ts < until_ms`` not returned before,
    in timestamp order: calling it on a timer yields an open-loop stream.

    Sensors are kept in order of their phase, so the measurements of consecutive ticks are
    already in time order when laid out tick by tick: no sorting, a few array operations per
    call. Noise comes from a pre-drawn pool of normal deviates read at a random offset.

    Attributes:
        gateway_id: prefix of the sensor ids.
        sensors: number of sensors.
        rate_hz: measurements per second per sensor.
        start_ms: event time of the first measurement.
        resolution: values are multiples of this.
        seed: random seed (phases, levels, noise).
        attributes: also emit name, type and unit (see ``KINDS``).
    """

    gateway_id: str
    sensors: int
    rate_hz: float
    start_ms: int
    resolution: float = 0.001
    seed: int = 0
    attributes: bool = False
    ids: tuple[str, ...] = field(init=False)
    _rng: np.random.Generator = field(init=False, repr=False)
    _phase_ms: npt.NDArray[np.float64] = field(init=False, repr=False)
    _codes: npt.NDArray[np.uint32] = field(init=False, repr=False)
    _level: npt.NDArray[np.float64] = field(init=False, repr=False)
    _noise: npt.NDArray[np.float64] = field(init=False, repr=False)
    _next: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        """Draw the per-sensor phases, levels and the noise pool."""
        if self.sensors <= 0 or self.rate_hz <= 0:
            raise ConfigError("sensors and rate_hz must be positive")
        self.ids = sensor_ids(self.gateway_id, self.sensors)
        self._rng = np.random.default_rng(self.seed)
        phase = self._rng.uniform(0.0, self.period_ms, self.sensors)
        order = np.argsort(phase, kind="stable")
        self._phase_ms = phase[order]
        self._codes = order.astype(np.uint32)
        self._level = self._rng.uniform(15.0, 35.0, self.sensors)[order]
        self._noise = self._rng.normal(0.0, 0.5, _NOISE_POOL) / self.resolution

    @property
    def period_ms(self) -> float:
        """Milliseconds between two measurements of one sensor."""
        return 1000.0 / self.rate_hz

    def take(self, until_ms: int) -> Measurements:
        """All measurements with event time before ``until_ms`` not yet taken.

        Laid out tick by tick, row ``r`` of a call is sensor ``(offset + r) % sensors`` of
        tick ``first + (offset + r) // sensors``: each per-sensor array is broadcast over the
        ticks and the rows cut out of it, and the noise is one contiguous run of the pool.
        Seven passes over the rows, no gathers (the simulator generates at several million
        measurements a second on the cores it shares with the pipeline it measures).
        """
        n = self.sensors
        first_tick, offset = divmod(self._next, n)
        # Tick k of the j-th sensor (in phase order) is at start + k * period + phase_j.
        last_tick = int(np.floor((until_ms - self.start_ms) / self.period_ms))
        if last_tick < first_tick:
            return _empty(self.ids)
        ticks = np.arange(first_tick, last_tick + 1, dtype=np.int64)
        times = (self.start_ms + ticks * self.period_ms)[:, None] + self._phase_ms[None, :]
        flat = times.ravel()[offset:]
        # sorted; floor(t) < until exactly when t < until, as until is a whole millisecond
        count = int(np.searchsorted(flat, until_ms, side="left"))
        if count == 0:
            return _empty(self.ids)
        end = offset + count
        ts = flat[:count].astype(np.int64)  # event times are positive: truncation is floor
        self._next += count
        slow = 2.0 * np.sin(float(ts[0]) / 60_000.0 + self._codes)  # slow drift, per sensor
        level = np.empty((len(ticks), n))
        level[:] = (self._level + slow) / self.resolution  # in units of the resolution
        units = level.ravel()[offset:end]
        units += self._noise_run(count)
        values = np.rint(units, out=units)
        values *= self.resolution
        sensors = np.tile(self._codes, len(ticks))[offset:end]
        if not self.attributes:
            return Measurements(DictColumn(self.ids, sensors), ts, values)
        kinds = sensors % len(KINDS)
        return Measurements(
            DictColumn(self.ids, sensors),
            ts,
            values,
            {name: DictColumn(words, codes[kinds]) for name, (words, codes) in _KIND_CODES.items()},
        )

    def _noise_run(self, count: int) -> npt.NDArray[np.float64]:
        """``count`` deviates of the pool (in units of the resolution) from a random offset."""
        pool = self._noise
        if count <= len(pool) // 2:
            start = int(self._rng.integers(0, len(pool) - count + 1))
            return pool[start : start + count]
        start = int(self._rng.integers(0, len(pool)))
        return pool[(start + np.arange(count)) % len(pool)]


LATE_STREAM: Final = 0x1A7E
"""Mixed into the seed of ``LateShare``: its draws never disturb the sensors' own."""


@dataclass
class LateShare:
    """Makes a share of a gateway's measurements late: their timestamps moved back.

    Each measurement is chosen on its own, with probability ``share``, from a random stream
    of its own (``seed`` and ``LATE_STREAM``): the n-th measurement a gateway generates is
    late or not whatever the blocks it arrives in, so the same seed gives the same late
    rows. A chosen measurement's ``ts`` moves back by ``by_ms``; with ``by_ms`` above the
    pipeline's ``lateness_ms`` plus its window size (and the batching delay) the windows it
    belongs to have closed for its gateway, so it is late by the per-gateway rule.

    Attributes:
        share: fraction of measurements made late, in [0, 1].
        by_ms: how far back a late measurement's timestamp moves (positive).
        seed: random seed.
        made_late: measurements made late so far.
    """

    share: float
    by_ms: int
    seed: int = 0
    made_late: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Check the share and the shift; seed the stream."""
        if not 0.0 <= self.share <= 1.0:
            raise ConfigError(f"the late share must lie in [0, 1], not {self.share}")
        if self.by_ms <= 0:
            raise ConfigError(f"late rows move back by a positive time, not {self.by_ms} ms")
        self._rng = np.random.default_rng((self.seed, LATE_STREAM))

    def apply(self, block: Measurements) -> Measurements:
        """``block`` with its chosen measurements' timestamps moved back by ``by_ms``."""
        if self.share == 0.0 or not len(block):
            return block
        late = self._rng.random(len(block)) < self.share
        count = int(np.count_nonzero(late))
        if count == 0:
            return block
        self.made_late += count
        return replace(block, ts=np.where(late, block.ts - self.by_ms, block.ts))


def synthetic_block(
    rows: int,
    *,
    sensors: int = 1000,
    rate_hz: float = 25.0,
    seed: int = 0,
    gateway_id: str = "gw00",
    start_ms: int = 1_700_000_000_000,
) -> Measurements:
    """Exactly ``rows`` measurements from a fresh ``SensorField`` (for benchmarks and tests)."""
    field_ = SensorField(gateway_id, sensors, rate_hz, start_ms, seed=seed)
    needed_ms = int(np.ceil(rows / (sensors * rate_hz) * 1000.0)) + int(field_.period_ms) + 2
    block = field_.take(start_ms + needed_ms)
    if len(block) < rows:
        raise AssertionError("synthetic field produced too few rows")
    return block.slice(0, rows)


def _empty(ids: tuple[str, ...]) -> Measurements:
    return Measurements(
        DictColumn(ids, np.zeros(0, dtype=np.uint32)),
        np.zeros(0, dtype=np.int64),
        np.zeros(0, dtype=np.float64),
    )
