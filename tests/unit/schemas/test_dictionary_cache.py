"""The binary decoder remembers dictionaries it has checked; the cache never weakens checks."""

from __future__ import annotations

import msgpack
import numpy as np
import polars as pl
import pytest

from shoal.errors import DecodeError, SchemaError
from shoal.schemas import (
    DecodeLimits,
    DictColumn,
    Encoding,
    Measurements,
    decode_batch,
    encode_batch,
)
from shoal.schemas._binary import _DictionaryCache


def payload(dictionary: tuple[str | None, ...], codes: list[int], seq: int = 0) -> bytes:
    block = Measurements(
        DictColumn(dictionary, np.array(codes, dtype=np.uint32)),
        np.arange(len(codes), dtype=np.int64) + 1_700_000_000_000,
        np.arange(len(codes), dtype=np.float64),
    )
    return encode_batch(
        block, gateway_id="gw", seq=seq, sent_at_ms=0, encoding=Encoding.BINARY_COLUMNAR
    )


def test_same_dictionary_twice_decodes_the_same_and_exposes_codes() -> None:
    first = decode_batch(payload(("a", "b", "c"), [2, 0, 1, 2], seq=1))
    second = decode_batch(payload(("a", "b", "c"), [2, 0, 1, 2], seq=2))
    assert first.frame.equals(second.frame)
    assert first.frame["sensor_id"].to_list() == ["c", "a", "b", "c"]
    coded = second.codes["sensor_id"]
    assert coded.values == ("a", "b", "c")
    assert coded.codes.tolist() == [2, 0, 1, 2]


def test_a_cached_dictionary_is_still_checked_against_the_limits() -> None:
    long = ("x" * 40,)
    decode_batch(payload(long, [0]))  # cached with the default limits
    with pytest.raises(DecodeError) as info:
        decode_batch(payload(long, [0]), limits=DecodeLimits(max_string_bytes=10))
    assert info.value.reason == "string_too_long"


def test_unhashable_dictionary_entries_are_a_schema_error() -> None:
    good = msgpack.unpackb(payload(("a",), [0]), raw=False)
    body = msgpack.unpackb(good["body"], raw=False)
    body["sensor_id"]["dict"] = [["a"]]
    good["body"] = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(SchemaError) as info:
        decode_batch(msgpack.packb(good, use_bin_type=True))
    assert info.value.reason == "bad_type"
    assert info.value.field == "sensor_id.dict[0]"


def test_the_least_recently_used_dictionary_is_the_one_forgotten() -> None:
    """A hit keeps a dictionary (the newest one without moving it); the oldest is dropped."""
    cache = _DictionaryCache(2)
    series = {name: pl.Series(name, [name]) for name in "abc"}

    def get(name: str) -> pl.Series | None:
        return cache.get("sensor_id", [name], 64, nullable=False)

    def put(name: str) -> None:
        cache.put("sensor_id", [name], 64, series[name], nullable=False)

    put("a")
    put("b")
    assert get("b") is series["b"]  # the newest: hit, stays newest
    assert get("a") is series["a"]  # now the newest; "b" the oldest
    assert get("a") is series["a"]
    put("c")
    assert get("b") is None
    assert get("a") is series["a"]
    assert get("c") is series["c"]
    put("b")  # "a" was used before "c"
    assert get("a") is None
    assert get("c") is series["c"]
