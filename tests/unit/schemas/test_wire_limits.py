"""``DecodeLimits`` at and just past each boundary, in every encoding it applies to."""

from __future__ import annotations

import msgpack
import polars as pl
import pytest
import zstandard

from shoal.errors import ConfigError, DecodeError, SchemaError
from shoal.schemas import (
    DEFAULT_LIMITS,
    FRAME_SCHEMA,
    DecodeLimits,
    Encoding,
    decode_batch,
    encode_batch,
)

T0 = 1_700_000_000_000
CODECS = [(e, False) for e in Encoding] + [(Encoding.BINARY_COLUMNAR, True)]
IDS = [f"{e.value}{'+zstd' if z else ''}" for e, z in CODECS]


def frame(n: int, *, sensor_id: str = "s", unit: str | None = None, t0: int = T0) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "sensor_id": [sensor_id] * n,
            "ts": [t0 + i for i in range(n)],
            "value": [float(i) for i in range(n)],
            "unit": [unit] * n,
        },
        schema={"sensor_id": pl.String, "ts": pl.Int64, "value": pl.Float64, "unit": pl.String},
    )


def encode(data: pl.DataFrame, encoding: Encoding, zstd: bool) -> bytes:
    return encode_batch(data, gateway_id="gw", seq=0, sent_at_ms=T0, encoding=encoding, zstd=zstd)


def test_defaults_are_documented_values() -> None:
    assert (
        DecodeLimits(
            max_payload_bytes=16 * 2**20,
            max_rows=1_000_000,
            max_string_bytes=256,
            max_decompressed_bytes=64 * 2**20,
            max_future_ms=300_000,
            max_past_ms=None,
        )
        == DEFAULT_LIMITS
    )


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
def test_payload_bytes_limit(encoding: Encoding, zstd: bool) -> None:
    payload = encode(frame(5), encoding, zstd)
    assert decode_batch(payload, limits=DecodeLimits(max_payload_bytes=len(payload)))
    with pytest.raises(DecodeError) as info:
        decode_batch(payload, limits=DecodeLimits(max_payload_bytes=len(payload) - 1))
    assert (info.value.reason, info.value.field) == ("payload_too_large", None)


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
def test_row_limit(encoding: Encoding, zstd: bool) -> None:
    payload = encode(frame(7), encoding, zstd)
    assert decode_batch(payload, limits=DecodeLimits(max_rows=7)).frame.height == 7
    with pytest.raises(DecodeError) as info:
        decode_batch(payload, limits=DecodeLimits(max_rows=6))
    field = "rows" if encoding in (Encoding.JSON_ROWS, Encoding.MSGPACK_ROWS) else "n"
    assert (info.value.reason, info.value.field) == ("too_many_rows", field)


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
@pytest.mark.parametrize("column", ["sensor_id", "unit"])
def test_string_limit_counts_utf8_bytes(encoding: Encoding, zstd: bool, column: str) -> None:
    limit = DecodeLimits(max_string_bytes=10)
    at_limit = "é" * 5  # 5 characters, 10 bytes
    over = "é" * 5 + "x"
    ok = frame(3, **{column: at_limit})
    assert decode_batch(encode(ok, encoding, zstd), limits=limit).frame.height == 3
    with pytest.raises(DecodeError) as info:
        decode_batch(encode(frame(3, **{column: over}), encoding, zstd), limits=limit)
    assert (info.value.reason, info.value.field, info.value.row) == ("string_too_long", column, 0)


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
def test_future_limit_is_relative_to_the_receivers_clock(encoding: Encoding, zstd: bool) -> None:
    payload = encode(frame(3), encoding, zstd)  # ts = T0, T0+1, T0+2
    future = DEFAULT_LIMITS.max_future_ms
    assert future is not None
    assert decode_batch(payload, now_ms=T0 + 2 - future).frame.height == 3
    with pytest.raises(SchemaError) as info:
        decode_batch(payload, now_ms=T0 + 1 - future)
    assert (info.value.reason, info.value.field, info.value.row) == ("ts_in_future", "ts", 2)
    assert decode_batch(payload).frame.height == 3  # no clock, no clock checks
    unbounded = DecodeLimits(max_future_ms=None)
    assert decode_batch(payload, limits=unbounded, now_ms=0).frame.height == 3


CLAMP = DecodeLimits(max_future_ms=1_000, on_future="clamp")


def clamp_payload(encoding: Encoding, zstd: bool, *, sent_at_ms: int) -> bytes:
    """Rows at T0, T0+1h, T0+1, T0+2h: two of them far ahead of a receiver at T0."""
    data = frame(4).with_columns(pl.Series("ts", [T0, T0 + 3_600_000, T0 + 1, T0 + 7_200_000]))
    return encode_batch(
        data, gateway_id="gw", seq=0, sent_at_ms=sent_at_ms, encoding=encoding, zstd=zstd
    )


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
def test_clamp_sets_far_future_rows_to_the_batchs_sent_at_and_counts_them(
    encoding: Encoding, zstd: bool
) -> None:
    payload = clamp_payload(encoding, zstd, sent_at_ms=T0 + 500)  # sealed on a sane clock
    with pytest.raises(SchemaError):  # the default refuses the batch whole
        decode_batch(payload, limits=DecodeLimits(max_future_ms=1_000), now_ms=T0)
    for now in (T0, T0 + 400):  # any worker, any re-send: the same reference, sent_at
        batch = decode_batch(payload, limits=CLAMP, now_ms=now)
        assert batch.clamped == 2
        assert batch.ts.tolist() == [T0, T0 + 500, T0 + 1, T0 + 500]
        assert batch.frame.get_column("ts").to_list() == batch.ts.tolist()
        assert batch.frame.get_column("value").to_list() == [0.0, 1.0, 2.0, 3.0]
        assert batch.rows == batch.envelope.rows == 4


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
def test_clamp_falls_back_to_the_receivers_clock_when_sent_at_is_beyond_the_limit_too(
    encoding: Encoding, zstd: bool
) -> None:
    payload = clamp_payload(encoding, zstd, sent_at_ms=T0 + 3_600_000)  # its clock is ahead
    batch = decode_batch(payload, limits=CLAMP, now_ms=T0 + 10)
    assert batch.clamped == 2
    assert batch.frame.get_column("ts").to_list() == [T0, T0 + 10, T0 + 1, T0 + 10]


def test_clamp_leaves_batches_within_the_limit_and_without_a_clock_alone() -> None:
    payload = clamp_payload(Encoding.MSGPACK_ROWS, False, sent_at_ms=T0)
    unclocked = decode_batch(payload, limits=CLAMP)
    assert unclocked.clamped == 0
    assert unclocked.ts.max() == T0 + 7_200_000
    inside = decode_batch(payload, limits=CLAMP, now_ms=T0 + 7_200_000 - 1_000)
    assert (inside.clamped, int(inside.ts.max())) == (0, T0 + 7_200_000)
    # Clamping is for the future only: the past limit still refuses the batch.
    both = DecodeLimits(max_future_ms=1_000, max_past_ms=0, on_future="clamp")
    with pytest.raises(SchemaError) as info:
        decode_batch(payload, limits=both, now_ms=T0 + 1)
    assert info.value.reason == "ts_in_past"


def test_clamp_needs_a_future_limit() -> None:
    with pytest.raises(ConfigError, match="needs a max_future_ms"):
        DecodeLimits(max_future_ms=None, on_future="clamp")
    with pytest.raises(ConfigError, match="on_future must be one of"):
        DecodeLimits(on_future="drop")  # type: ignore[arg-type]


@pytest.mark.parametrize(("encoding", "zstd"), CODECS, ids=IDS)
def test_past_limit_is_off_by_default(encoding: Encoding, zstd: bool) -> None:
    payload = encode(frame(3), encoding, zstd)
    now = T0 + 10**12
    assert decode_batch(payload, now_ms=now).frame.height == 3
    limits = DecodeLimits(max_past_ms=1000)
    assert decode_batch(payload, limits=limits, now_ms=T0 + 1000).frame.height == 3
    with pytest.raises(SchemaError) as info:
        decode_batch(payload, limits=limits, now_ms=T0 + 1001)
    assert (info.value.reason, info.value.field, info.value.row) == ("ts_in_past", "ts", 0)


def test_contract_range_holds_without_a_clock() -> None:
    for ts, reason in [(-1, "ts_in_past"), (2**53, "ts_in_future")]:
        payload = msgpack.packb(
            {
                "shoal": 1,
                "enc": "msgpack-columnar",
                "gateway_id": "gw",
                "seq": 0,
                "sent_at": 0,
                "n": 2,
                "cols": {"sensor_id": ["a", "a"], "ts": [0, ts], "value": [1.0, 2.0]},
            }
        )
        with pytest.raises(SchemaError) as info:
            decode_batch(payload)
        assert (info.value.reason, info.value.row) == (reason, 1)


def zstd_batch(body: bytes, n: int = 1) -> bytes:
    top = {"shoal": 1, "enc": "binary-columnar", "gateway_id": "gw", "seq": 0, "sent_at": 0}
    packed: bytes = msgpack.packb({**top, "n": n, "comp": "zstd", "body": body})
    return packed


@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "unsized"])
def test_decompressed_size_limit_stops_bombs(content_size: bool) -> None:
    compressor = zstandard.ZstdCompressor(write_content_size=content_size)
    payload = encode(frame(50), Encoding.BINARY_COLUMNAR, zstd=True)
    inner = zstandard.ZstdDecompressor().decompress(msgpack.unpackb(payload)["body"])
    exact = zstd_batch(compressor.compress(inner), n=50)
    assert decode_batch(exact, limits=DecodeLimits(max_decompressed_bytes=len(inner))).frame.height
    with pytest.raises(DecodeError) as info:
        decode_batch(exact, limits=DecodeLimits(max_decompressed_bytes=len(inner) - 1))
    assert (info.value.reason, info.value.field) == ("decompressed_too_large", "body")
    # A real bomb: 128 MiB of zeros in a few KiB, twice the default limit.
    bomb = zstd_batch(compressor.compress(bytes(2**27)) if content_size else _unsized_bomb())
    assert len(bomb) < 64 * 2**10
    with pytest.raises(DecodeError) as info:
        decode_batch(bomb)
    assert info.value.reason == "decompressed_too_large"


def _unsized_bomb() -> bytes:
    # Stream 128 MiB of zeros through a compressor without holding them all.
    compressor = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    chunk = bytes(2**24)
    parts = [compressor.compress(chunk) for _ in range(8)]
    return b"".join(parts) + compressor.flush()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_payload_bytes": 0},
        {"max_rows": 0},
        {"max_string_bytes": -1},
        {"max_decompressed_bytes": 0},
        {"max_future_ms": -1},
        {"max_past_ms": -5},
    ],
)
def test_limits_that_could_never_admit_a_batch_are_config_errors(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        DecodeLimits(**kwargs)


def test_an_empty_batch_passes_every_limit() -> None:
    tight = DecodeLimits(max_rows=1, max_string_bytes=1, max_future_ms=0, max_past_ms=0)
    for encoding, zstd in CODECS:
        batch = decode_batch(encode(frame(0), encoding, zstd), limits=tight, now_ms=0)
        assert batch.frame.schema == FRAME_SCHEMA
        assert batch.frame.height == 0
