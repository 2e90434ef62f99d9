"""Codec bugs found while writing the contract down; each test fails without its fix."""

from __future__ import annotations

import msgpack
import orjson
import pytest
import zstandard

from shoal.errors import DecodeError, SchemaError
from shoal.schemas import decode_batch
from shoal.schemas.control import Confirm

T0 = 1_700_000_000_000


def head(enc: str) -> dict[str, object]:
    return {"shoal": 1, "enc": enc, "gateway_id": "gw-1", "seq": 3, "sent_at": T0}


BODY = msgpack.packb(
    {
        "sensor_id": {"dict": ["a"], "dtype": "u1", "codes": b"\x00"},
        "ts": {"base": T0, "dtype": "u1", "data": b"\x00"},
        "value": {"dtype": "f8", "data": bytes(8)},
    }
)


def binary(body: bytes, comp: str = "zstd") -> bytes:
    top = {**head("binary-columnar"), "n": 1, "comp": comp, "body": body}
    packed: bytes = msgpack.packb(top)
    return packed


@pytest.mark.parametrize("enc", ["msgpack-columnar", "binary-columnar"])
def test_json_text_naming_a_columnar_encoding_is_a_mismatch_not_a_key_error(enc: str) -> None:
    body = (
        {"n": 0, "cols": {}} if enc == "msgpack-columnar" else {"n": 0, "comp": "none", "body": ""}
    )
    with pytest.raises(DecodeError) as info:
        decode_batch(orjson.dumps({**head(enc), **body}))
    assert (info.value.reason, info.value.field) == ("encoding_mismatch", "enc")


@pytest.mark.parametrize("column", ["sensor_id", "ts", "value", "unit"])
@pytest.mark.parametrize(
    "bad", [msgpack.ExtType(5, b"xy"), msgpack.Timestamp(1, 0)], ids=["ext", "timestamp"]
)
def test_extension_values_in_a_column_are_bad_type(column: str, bad: object) -> None:
    # polars turned a column of ExtType (a namedtuple) into a struct, and raised ValueError
    # on Timestamp; both escaped decode_batch as foreign errors.
    cols: dict[str, list[object]] = {"sensor_id": ["a"], "ts": [T0], "value": [1.0]}
    cols[column] = [bad]
    payload = msgpack.packb({**head("msgpack-columnar"), "n": 1, "cols": cols})
    with pytest.raises(SchemaError) as info:
        decode_batch(payload)
    assert (info.value.reason, info.value.field, info.value.row) == ("bad_type", column, 0)
    assert "array" not in str(info.value)  # an ExtType is not described as an array


@pytest.mark.parametrize("dtype", [[], {}], ids=["array", "map"])
def test_an_unhashable_buffer_dtype_is_bad_dtype(dtype: object) -> None:
    body = msgpack.unpackb(BODY)
    body["ts"]["dtype"] = dtype
    with pytest.raises(SchemaError) as info:
        decode_batch(binary(msgpack.packb(body), comp="none"))
    assert (info.value.reason, info.value.field) == ("bad_dtype", "ts.dtype")


@pytest.mark.parametrize("content_size", [True, False], ids=["sized", "unsized"])
@pytest.mark.parametrize("tail", [b"\x00", b"junk", "frame"])
def test_bytes_after_the_zstd_frame_are_refused(content_size: bool, tail: bytes | str) -> None:
    # They were ignored (sized frames) or decoded as more body (unsized frames), so the same
    # bytes meant different things depending on a frame header flag.
    compressor = zstandard.ZstdCompressor(write_content_size=content_size)
    extra = compressor.compress(b"") if tail == "frame" else tail
    assert isinstance(extra, bytes)
    assert decode_batch(binary(compressor.compress(BODY))).frame.height == 1
    with pytest.raises(DecodeError) as info:
        decode_batch(binary(compressor.compress(BODY) + extra))
    assert (info.value.reason, info.value.field) == ("bad_compression", "body")


def test_a_truncated_unsized_zstd_frame_is_bad_compression() -> None:
    # The stream reader returned no bytes and no error; the empty body then read as bad MsgPack.
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(BODY)
    with pytest.raises(DecodeError) as info:
        decode_batch(binary(frame[:-3]))
    assert (info.value.reason, info.value.field) == ("bad_compression", "body")


def test_confirm_version_true_is_not_version_1() -> None:
    good = orjson.loads(Confirm("gw-1", "p", 0, 1, 5, T0).to_json())
    with pytest.raises(SchemaError) as info:
        Confirm.from_json(orjson.dumps({**good, "shoal": True}))
    assert (info.value.reason, info.value.field) == ("unsupported_version", "shoal")


@pytest.mark.parametrize("column", ["sensor_id", "ts", "value", "unit"])
def test_a_nested_msgpack_timestamp_is_bad_type_not_a_polars_panic(column: str) -> None:
    # polars raised PanicException (a BaseException) on a list holding a msgpack.Timestamp.
    cols: dict[str, list[object]] = {"sensor_id": ["a"], "ts": [T0], "value": [1.0]}
    cols[column] = [[msgpack.Timestamp(1, 0)]]
    payload = msgpack.packb({**head("msgpack-columnar"), "n": 1, "cols": cols})
    with pytest.raises(SchemaError) as info:
        decode_batch(payload)
    assert (info.value.reason, info.value.field, info.value.row) == ("bad_type", column, 0)


def test_a_signalling_nan_in_an_f4_buffer_is_not_finite_without_a_warning() -> None:
    # Widening it to float64 raised RuntimeWarning, an error under pytest's -W error.
    body = msgpack.unpackb(BODY)
    body["value"] = {"dtype": "f4", "data": bytes.fromhex("0100807f")}
    with pytest.raises(SchemaError) as info:
        decode_batch(binary(msgpack.packb(body), comp="none"))
    assert (info.value.reason, info.value.field, info.value.row) == ("not_finite", "value", 0)
