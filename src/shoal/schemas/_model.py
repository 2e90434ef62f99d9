"""The vocabulary of the wire format: encodings, envelope, limits, the decoded frame's schema.

Owns no I/O and imports nothing from the rest of shoal but ``errors``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final, Literal

import numpy as np
import numpy.typing as npt
import polars as pl

from shoal.errors import ConfigError, SchemaError, UsageError

SCHEMA_VERSION: Final = 1
"""The wire-format version this codec writes and reads (the ``shoal`` key of every batch)."""

MIN_TS_MS: Final = 0
"""Smallest timestamp the contract admits (1970-01-01T00:00:00Z)."""

MAX_TS_MS: Final = 2**53 - 1
"""Largest timestamp the contract admits: exact in an IEEE double, so JavaScript can send it."""

MAX_SEQ: Final = 2**63 - 1

FuturePolicy = Literal["deadletter", "clamp"]
"""What a decoder does with timestamps beyond ``max_future_ms``: refuse the batch, or clamp."""

FUTURE_POLICIES: Final[tuple[FuturePolicy, ...]] = ("deadletter", "clamp")

ATTRIBUTE_COLUMNS: Final = ("name", "type", "unit")
"""Optional per-measurement attributes (the research's sensor model)."""

FRAME_SCHEMA: Final = pl.Schema(
    {
        "sensor_id": pl.String(),
        "ts": pl.Int64(),
        "value": pl.Float64(),
        "name": pl.String(),
        "type": pl.String(),
        "unit": pl.String(),
    }
)
"""Every decoded batch is a DataFrame with exactly these columns, in this order.

``sensor_id``, ``ts`` and ``value`` are never null; ``value`` is always finite. The
attributes are null where a measurement does not carry them.
"""


class Encoding(enum.StrEnum):
    """The four first-class encodings of a batch (the ``enc`` key of every batch)."""

    JSON_ROWS = "json-rows"
    MSGPACK_ROWS = "msgpack-rows"
    MSGPACK_COLUMNAR = "msgpack-columnar"
    BINARY_COLUMNAR = "binary-columnar"

    @property
    def content_type(self) -> str:
        """The MQTT 5 content type that names this encoding."""
        return _CONTENT_TYPES[self]

    @property
    def is_json(self) -> bool:
        """Whether the payload is JSON text (the others are MsgPack)."""
        return self is Encoding.JSON_ROWS

    @classmethod
    def parse(cls, text: str) -> Encoding:
        """Parse a user-supplied encoding name (also accepts short aliases)."""
        normalized = text.strip().lower().replace("_", "-")
        normalized = _ALIASES.get(normalized, normalized)
        try:
            return cls(normalized)
        except ValueError:
            names = ", ".join(e.value for e in cls)
            raise ConfigError(
                f"unknown encoding {text!r}; choose one of {names} "
                "(or the aliases json, msgpack, columnar, binary)"
            ) from None


_CONTENT_TYPES: Final = {
    Encoding.JSON_ROWS: "application/vnd.shoal.v1.rows+json",
    Encoding.MSGPACK_ROWS: "application/vnd.shoal.v1.rows+msgpack",
    Encoding.MSGPACK_COLUMNAR: "application/vnd.shoal.v1.columnar+msgpack",
    Encoding.BINARY_COLUMNAR: "application/vnd.shoal.v1.binary+msgpack",
}

_ALIASES: Final = {
    "json": "json-rows",
    "msgpack": "msgpack-rows",
    "columnar": "msgpack-columnar",
    "binary": "binary-columnar",
}

CONTENT_TYPE_TO_ENCODING: Final = {ct: enc for enc, ct in _CONTENT_TYPES.items()}

GENERIC_JSON_TYPES: Final = frozenset({"application/json", "text/json"})
"""Generic content types some MQTT tools set; the in-band marker then names the encoding."""

GENERIC_MSGPACK_TYPES: Final = frozenset(
    {"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"}
)


@dataclass(frozen=True, slots=True)
class Envelope:
    """The batch envelope: who sent it, its place in the gateway's sequence, and how.

    Attributes:
        gateway_id: the sending gateway; also the last segment of its ingest topic.
        seq: strictly increasing per gateway, across gateway restarts.
        sent_at_ms: gateway wall clock when the batch was sealed (epoch ms).
        encoding: how the measurements are encoded.
        rows: number of measurements in the batch.
        version: wire-format version.
    """

    gateway_id: str
    seq: int
    sent_at_ms: int
    encoding: Encoding
    rows: int
    version: int = SCHEMA_VERSION


FrameBuilder = Callable[[Collection[str] | None], pl.DataFrame]
"""Builds a batch's frame on demand: the ``FRAME_SCHEMA`` columns among those given (None:
all of them), in schema order."""


class Batch:
    """A decoded batch: its envelope and its measurements as a ``FRAME_SCHEMA`` DataFrame.

    ``codes`` holds the string columns that arrived dictionary-coded (binary columnar), by
    column name, so consumers can group on integer codes without re-hashing the strings.
    ``ts`` and ``value`` are the two numeric columns as numpy arrays. A decoder that has
    them as arrays already (binary columnar) passes a function for the frame instead of the
    frame: it is built on first use, so a consumer that needs only the arrays and the codes
    (a worker) never pays for the string columns. ``clamped`` counts the rows whose
    timestamps the decoder clamped (``DecodeLimits.on_future == "clamp"``).
    """

    __slots__ = ("_build", "_frame", "clamped", "codes", "envelope", "ts", "value")

    def __init__(
        self,
        envelope: Envelope,
        frame: pl.DataFrame | FrameBuilder,
        codes: dict[str, DictColumn] | None = None,
        *,
        ts: npt.NDArray[np.int64] | None = None,
        value: npt.NDArray[np.float64] | None = None,
        clamped: int = 0,
    ) -> None:
        self.envelope = envelope
        self.clamped = clamped
        self.codes = codes if codes is not None else {}
        if isinstance(frame, pl.DataFrame):
            self._frame: pl.DataFrame | None = frame
            self._build: FrameBuilder | None = None
            ts = frame.get_column("ts").to_numpy() if ts is None else ts
            value = frame.get_column("value").to_numpy() if value is None else value
        elif ts is None or value is None:
            raise UsageError("a batch built on demand needs its ts and value arrays")
        else:
            self._frame, self._build = None, frame
        self.ts: npt.NDArray[np.int64] = ts
        self.value: npt.NDArray[np.float64] = value

    @property
    def frame(self) -> pl.DataFrame:
        """The measurements (``FRAME_SCHEMA``), built on first use if need be."""
        if self._frame is None:
            assert self._build is not None  # one of the two is always set
            self._frame, self._build = self._build(None), None
        return self._frame

    def columns(self, names: Collection[str]) -> pl.DataFrame:
        """The measurements' columns among ``names``, in ``FRAME_SCHEMA`` order.

        A batch whose frame is built on demand builds only these (not kept): a consumer that
        reads a few columns does not pay for the string columns it never reads.
        """
        if self._frame is not None:
            return self._frame.select(n for n in self._frame.columns if n in names)
        assert self._build is not None
        return self._build(names)

    @property
    def rows(self) -> int:
        """Number of measurements."""
        return len(self.ts)

    def __repr__(self) -> str:
        return f"Batch({self.envelope!r}, rows={self.rows})"


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Explicit bounds on what a decoder accepts; anything beyond is a typed error.

    Attributes:
        max_payload_bytes: size of the raw MQTT payload.
        max_rows: measurements in one batch.
        max_string_bytes: UTF-8 length of a sensor id or attribute.
        max_decompressed_bytes: size of a zstd-compressed body once inflated (zip bombs).
        max_future_ms: how far past the decoder's clock a timestamp may lie; needs ``now_ms``.
        max_past_ms: how far before the decoder's clock a timestamp may lie (None: no bound).
        on_future: what happens to a batch with timestamps beyond ``max_future_ms``:
            ``deadletter`` refuses it whole (``ts_in_future``); ``clamp`` keeps it and sets
            those timestamps to a reference time (``clamp_future``), counting them.
    """

    max_payload_bytes: int = 16 * 1024 * 1024
    max_rows: int = 1_000_000
    max_string_bytes: int = 256
    max_decompressed_bytes: int = 64 * 1024 * 1024
    max_future_ms: int | None = 5 * 60 * 1000
    max_past_ms: int | None = None
    on_future: FuturePolicy = "deadletter"

    def __post_init__(self) -> None:
        """Reject limits that could never admit a batch."""
        for name in ("max_payload_bytes", "max_rows", "max_string_bytes", "max_decompressed_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"decode limit {name} must be positive")
        for name in ("max_future_ms", "max_past_ms"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"decode limit {name} must be >= 0 or None")
        if self.on_future not in FUTURE_POLICIES:
            raise ConfigError(
                f"decode limit on_future must be one of {list(FUTURE_POLICIES)}, "
                f"not {self.on_future!r}"
            )
        if self.on_future == "clamp" and self.max_future_ms is None:
            raise ConfigError("on_future = 'clamp' needs a max_future_ms to clamp to")


def null_strings(name: str, n: int) -> pl.Series:
    """An all-null String series of length ``n`` (an attribute no measurement carries)."""
    return pl.Series(name, [None], dtype=pl.String).new_from_index(0, n)


@dataclass(frozen=True, slots=True)
class DictColumn:
    """A dictionary-coded string column: ``values[codes[i]]`` is row ``i``.

    ``values`` may hold ``None`` (a null attribute); sensor ids never do.
    """

    values: tuple[str | None, ...]
    codes: npt.NDArray[np.uint32]

    def to_series(self, name: str) -> pl.Series:
        """Materialise the column as a polars String series."""
        dictionary = pl.Series(name, self.values, dtype=pl.String)
        return dictionary.gather(pl.Series(self.codes))


@dataclass(frozen=True, slots=True)
class Measurements:
    """A columnar block of measurements, the input of every encoder.

    Producers that already hold codes (the gateway library, the simulator) build it directly
    from arrays without per-row Python objects; ``from_frame`` converts any DataFrame.
    """

    sensor_id: DictColumn
    ts: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]
    attributes: dict[str, DictColumn] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check that all columns have one length and the attributes are known."""
        n = len(self.ts)
        lengths = {len(self.sensor_id.codes), len(self.value), n}
        lengths.update(len(col.codes) for col in self.attributes.values())
        if len(lengths) != 1:
            raise SchemaError(
                "columns differ in length",
                reason="length_mismatch",
                expected="one length for every column",
                found=str(sorted(lengths)),
            )
        unknown = set(self.attributes) - set(ATTRIBUTE_COLUMNS)
        if unknown:
            raise SchemaError(
                "unknown attribute columns",
                reason="unknown_field",
                expected=", ".join(ATTRIBUTE_COLUMNS),
                found=", ".join(sorted(unknown)),
            )

    def __len__(self) -> int:
        return len(self.ts)

    @classmethod
    def from_frame(cls, frame: pl.DataFrame) -> Measurements:
        """Build from a DataFrame holding at least ``sensor_id``, ``ts`` and ``value``.

        All-null attribute columns are dropped (the encoders then omit them).
        """
        attributes: dict[str, DictColumn] = {
            name: _dict_code(frame.get_column(name))
            for name in ATTRIBUTE_COLUMNS
            if name in frame.columns and frame.get_column(name).null_count() < frame.height
        }
        return cls(
            sensor_id=_dict_code(frame.get_column("sensor_id")),
            ts=frame.get_column("ts").cast(pl.Int64).to_numpy(),
            value=frame.get_column("value").cast(pl.Float64).to_numpy(),
            attributes=attributes,
        )

    def to_frame(self) -> pl.DataFrame:
        """The measurements as a ``FRAME_SCHEMA`` DataFrame."""
        n = len(self)
        columns = [
            self.sensor_id.to_series("sensor_id"),
            pl.Series("ts", self.ts, dtype=pl.Int64),
            pl.Series("value", self.value, dtype=pl.Float64),
        ]
        for name in ATTRIBUTE_COLUMNS:
            col = self.attributes.get(name)
            columns.append(col.to_series(name) if col is not None else null_strings(name, n))
        return pl.DataFrame(columns)

    def slice(self, start: int, stop: int) -> Measurements:
        """Rows ``start:stop`` (dictionaries are shared, not copied)."""
        return Measurements(
            sensor_id=DictColumn(self.sensor_id.values, self.sensor_id.codes[start:stop]),
            ts=self.ts[start:stop],
            value=self.value[start:stop],
            attributes={
                k: DictColumn(v.values, v.codes[start:stop]) for k, v in self.attributes.items()
            },
        )


def _dict_code(series: pl.Series) -> DictColumn:
    """Dictionary-code a string series in first-seen order, without a Python loop."""
    first = series.arg_unique()
    uniques = series.gather(first)
    codes = (
        series.replace_strict(
            uniques, pl.int_range(uniques.len(), eager=True), return_dtype=pl.UInt32
        )
        if series.null_count() == 0
        else _codes_with_nulls(series, uniques)
    )
    return DictColumn(tuple(uniques.to_list()), codes.to_numpy().astype(np.uint32, copy=False))


def _codes_with_nulls(series: pl.Series, uniques: pl.Series) -> pl.Series:
    # replace_strict cannot map null; route it through a placeholder index.
    null_index = uniques.to_list().index(None)
    non_null = uniques.drop_nulls()
    mapping = [i for i, v in enumerate(uniques.to_list()) if v is not None]
    return series.replace_strict(
        non_null, pl.Series(mapping, dtype=pl.UInt32), default=null_index, return_dtype=pl.UInt32
    )
