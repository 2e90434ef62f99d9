"""The encoding study (the research's second paper): bytes and CPU per measurement, per encoding.

For every codec, and for readings of 1 and of 10 attributes, one batch of ``rows``
measurements is encoded as the gateway library does (from a columnar ``Measurements`` block)
and handled as a worker does (strict decode to the frame, partials for every combiner
partition, partials encoded for the wire). Reported per codec: bytes per measurement and CPU
seconds per million measurements at each end (process CPU time, median of ``repeats``
samples, so polars threads are charged too).

A reading of ``k`` attributes is ``k`` measurements in shoal's model (one value each), keyed
``<sensor>/a<j>`` with the reading's timestamp: with 10 attributes, row formats repeat the
field names and the sensor id ten times per reading, columnar ones store them once.

The research's baseline is a row of the table too: its gateways' JSON rows (sensor id,
name, type, unit, value, ts) and its service's work per batch (parse into pandas, per-sensor
statistics, reply), timed the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np
import orjson

from shoal.loadtest.baseline import app as baseline_app
from shoal.loadtest.baseline._extra import require
from shoal.loadtest.baseline.driver import RowEncoder
from shoal.loadtest.bench_encodings import CODECS, Codec, _median_seconds, encode_with
from shoal.loadtest.data import synthetic_block
from shoal.processors.partials import BatchInfo, PartialBuilder
from shoal.processors.spec import PipelineSpec
from shoal.schemas import DictColumn, Measurements, decode_batch

ATTRIBUTE_COUNTS: Final = (1, 10)
DEVICES: Final = 1_000
BASELINE: Final = "baseline: JSON rows + pandas"
_GATEWAY: Final = "study-gw"
_SENT_AT_MS: Final = 1_700_000_000_000


@dataclass(frozen=True, slots=True)
class StudyRow:
    """One codec at one attribute count.

    Attributes:
        codec: encoding name (``+zstd`` when compressed), or the baseline's label.
        attributes: values per reading (measurements per reading).
        rows: measurements per batch.
        bytes_per_meas: payload bytes per measurement.
        gateway_cpu_s_per_million: CPU seconds to encode a million measurements.
        decode_cpu_s_per_million: CPU seconds to decode them (worker; baseline: parse).
        worker_cpu_s_per_million: CPU seconds for decode + partials + encoded partials
            (baseline: parse into pandas + statistics + JSON reply).
    """

    codec: str
    attributes: int
    rows: int
    bytes_per_meas: float
    gateway_cpu_s_per_million: float
    decode_cpu_s_per_million: float
    worker_cpu_s_per_million: float

    def as_record(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def readings_block(rows: int, attributes: int) -> Measurements:
    """``rows`` measurements: readings of ``attributes`` values each from ``DEVICES`` sensors."""
    readings = synthetic_block(-(-rows // attributes), sensors=DEVICES)
    if attributes == 1:
        return readings.slice(0, rows)
    devices = readings.sensor_id.values
    ids = tuple(f"{device}/a{j}" for device in devices for j in range(attributes))
    offsets = np.arange(attributes, dtype=np.uint32)
    codes = (readings.sensor_id.codes[:, None] * attributes + offsets[None, :]).ravel()
    values = (readings.value[:, None] + offsets[None, :]).ravel()
    ts = np.repeat(readings.ts, attributes)
    return Measurements(DictColumn(ids, codes[:rows]), ts[:rows], values[:rows])


def _cpu_per_million(call: Callable[[], object], rows: int, repeats: int) -> float:
    return _median_seconds(call, repeats, time.process_time) / rows * 1e6


def measure_codec(
    block: Measurements, codec: Codec, builder: PartialBuilder, attributes: int, repeats: int
) -> StudyRow:
    """Encode, decode and build partials for ``block`` with ``codec``."""
    n = len(block)

    def encode() -> bytes:
        return encode_with(block, codec)

    payload = encode()
    content_type = codec.encoding.content_type

    def decode() -> object:
        return decode_batch(payload, content_type=content_type)

    def work() -> object:
        batch = decode_batch(payload, content_type=content_type)
        info = BatchInfo(
            gateway_id=_GATEWAY,
            seq=1,
            stream="study",
            rows=batch.rows,
            min_ts=None,
            max_ts=None,
            sent_at_ms=_SENT_AT_MS,
            received_at_ms=_SENT_AT_MS,
            worker="study",
        )
        partials = builder.build_batch(batch, info, _SENT_AT_MS)
        return [p.encode() for p in partials]

    return StudyRow(
        codec=codec.label,
        attributes=attributes,
        rows=n,
        bytes_per_meas=round(len(payload) / n, 2),
        gateway_cpu_s_per_million=round(_cpu_per_million(encode, n, repeats), 3),
        decode_cpu_s_per_million=round(_cpu_per_million(decode, n, repeats), 3),
        worker_cpu_s_per_million=round(_cpu_per_million(work, n, repeats), 3),
    )


def measure_baseline(block: Measurements, attributes: int, repeats: int) -> StudyRow:
    """The research's gateway encoding and service work for ``block``."""
    n = len(block)
    pd = require("pandas")
    ids = tuple(str(sensor) for sensor in block.sensor_id.values)
    encoder = RowEncoder(_GATEWAY, ids, attributes=True)
    body = encoder.encode(block, 1, _SENT_AT_MS)
    return StudyRow(
        codec=BASELINE,
        attributes=attributes,
        rows=n,
        bytes_per_meas=round(len(body) / n, 2),
        gateway_cpu_s_per_million=round(
            _cpu_per_million(lambda: encoder.encode(block, 1, _SENT_AT_MS), n, repeats), 3
        ),
        decode_cpu_s_per_million=round(_cpu_per_million(lambda: orjson.loads(body), n, repeats), 3),
        worker_cpu_s_per_million=round(
            _cpu_per_million(lambda: baseline_app.analyse(body, pd), n, repeats), 3
        ),
    )


def run(
    spec: PipelineSpec,
    rows: int = 16_000,
    repeats: int = 5,
    *,
    attribute_counts: Sequence[int] = ATTRIBUTE_COUNTS,
    codecs: Sequence[Codec] = CODECS,
    progress: Callable[[StudyRow], None] | None = None,
) -> list[StudyRow]:
    """The baseline and every codec, for every attribute count."""
    builder = PartialBuilder(spec, "study")
    out = []
    for attributes in attribute_counts:
        block = readings_block(rows, attributes)
        results = [measure_baseline(block, attributes, repeats)]
        results.extend(measure_codec(block, c, builder, attributes, repeats) for c in codecs)
        for result in results:
            if progress is not None:
                progress(result)
        out.extend(results)
    return out
