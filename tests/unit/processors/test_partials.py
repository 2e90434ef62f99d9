"""Partials: wire round trip, strict decoding, stable routing, one partial per partition."""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections import Counter
from typing import Any

import msgpack
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from shoal.errors import SchemaError
from shoal.processors.partials import (
    PARTIAL_VERSION,
    BatchInfo,
    KeyRouter,
    Partial,
    PartialBuilder,
    spec_fingerprint,
)
from shoal.processors.spec import PipelineSpec, parse_pipeline
from tests.support.datasets import frame_of

BASE: dict[str, Any] = {
    "name": "p",
    "windows": [
        {"kind": "tumbling", "size_ms": 1_000},
        {"kind": "hopping", "size_ms": 3_000, "slide_ms": 1_000},
    ],
    "aggregates": ["count", "sum", "min", "max", "first", "last", "stddev", "p50", "p99"],
    "partitions": 3,
}


def spec_of(**changes: Any) -> PipelineSpec:
    return parse_pipeline({**BASE, **changes})


def info(seq: int = 0, **changes: Any) -> BatchInfo:
    batch = BatchInfo("gw-1", seq, "s", 0, None, None, 1_000, 2_000, "w1")
    return dataclasses.replace(batch, **changes)


ROWS = [(f"sensor-{i % 11}", 10_000 + 37 * i, float(i % 7) - 2.5) for i in range(60)]


# -- wire form ---------------------------------------------------------------------------------


def assert_same(a: Partial, b: Partial) -> None:
    for name in ("pipeline", "fingerprint", "partition", "partitions", "batch", "produced_at_ms"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("aggs", "sketch"):
        left, right = getattr(a, name), getattr(b, name)
        if left is None:
            assert right is None, name
        else:
            assert_frame_equal(left, right, check_exact=True)


def test_round_trip_with_state() -> None:
    partials = PartialBuilder(spec_of(), "w1").build(frame_of(ROWS), info(), 5_000)
    assert any(p.aggs is not None for p in partials)
    assert any(p.sketch is not None for p in partials)
    for p in partials:
        assert_same(Partial.decode(p.encode()), p)


def test_round_trip_keeps_none_frames_and_rejections() -> None:
    builder = PartialBuilder(spec_of(), "w1")
    empty = builder.build(frame_of([]), info(seq=3), 5_000)
    rejected = builder.rejected(info(seq=4, status="rejected", reason="bad_json"), 5_000)
    for p in empty + rejected:
        assert p.aggs is None
        assert p.sketch is None
        decoded = Partial.decode(p.encode())
        assert_same(decoded, p)
    assert Partial.decode(rejected[0].encode()).batch.reason == "bad_json"
    assert Partial.decode(rejected[0].encode()).batch.status == "rejected"


def test_round_trip_huge_numbers() -> None:
    batch = info(seq=2**63 - 1, sent_at_ms=2**53 - 1, received_at_ms=0)
    partials = PartialBuilder(spec_of(partitions=1), "w1").build(
        frame_of([("k", 2**53 - 1, 1e300), ("k", 0, -1e-300)]), batch, 2**53 - 1
    )
    decoded = Partial.decode(partials[0].encode())
    assert_same(decoded, partials[0])
    assert decoded.batch.min_ts == 0
    assert decoded.batch.max_ts == 2**53 - 1


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=300))
def test_random_bytes_are_a_schema_error(payload: bytes) -> None:
    with pytest.raises(SchemaError) as caught:
        Partial.decode(payload)
    assert caught.value.reason == "bad_partial"


def valid_payload() -> bytes:
    partials = PartialBuilder(spec_of(partitions=1), "w1").build(frame_of(ROWS), info(), 5_000)
    return partials[0].encode()


def test_every_truncation_is_a_schema_error() -> None:
    payload = valid_payload()
    for end in range(0, len(payload), max(1, len(payload) // 200)):
        with pytest.raises(SchemaError):
            Partial.decode(payload[:end])


@pytest.mark.parametrize(
    ("change", "drop"),
    [
        ({"v": PARTIAL_VERSION + 1}, None),
        ({"v": "1"}, None),
        ({"seq": "seven"}, None),
        ({"state": b"not a map"}, None),
        ({"state": {"window": b"", "start": b"", "keys": "k", "fields": {}}}, None),
        ({}, "gateway_id"),
        ({}, "fp"),
        ({}, "state"),
        ({}, "produced_at"),
    ],
)
def test_malformed_maps_are_schema_errors(change: dict[str, Any], drop: str | None) -> None:
    obj = msgpack.unpackb(valid_payload(), raw=False)
    obj.update(change)
    if drop is not None:
        del obj[drop]
    with pytest.raises(SchemaError):
        Partial.decode(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("obj", [None, 1, "partial", [1, 2], {"v": 1}])
def test_non_partials_are_schema_errors(obj: object) -> None:
    with pytest.raises(SchemaError):
        Partial.decode(msgpack.packb(obj, use_bin_type=True))


def test_inconsistent_state_buffers_are_schema_errors() -> None:
    """Buffers whose lengths disagree with the key count, or that are not whole values."""
    obj = msgpack.unpackb(valid_payload(), raw=False)
    state = obj["state"]

    def refused(broken_state: dict[str, Any]) -> None:
        with pytest.raises(SchemaError):
            Partial.decode(msgpack.packb({**obj, "state": broken_state}, use_bin_type=True))

    refused({**state, "window": state["window"][:-1]})
    base, dtype, data = state["start"]
    refused({**state, "start": [base, dtype, data[:-1]]})
    refused({**state, "start": [base, "f8", data]})  # not an integer width
    refused({**state, "start": ["0", dtype, data]})  # base must be an integer
    field = next(f for f in state["fields"] if isinstance(state["fields"][f], bytes))
    refused({**state, "fields": {**state["fields"], field: state["fields"][field] + b"\x00"}})
    refused({**state, "keys": state["keys"][:-1]})


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_corrupt_payloads_never_escape_as_other_errors(data: st.DataObject) -> None:
    payload = bytearray(valid_payload())
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(payload) - 1))
        payload[index] = data.draw(st.integers(0, 255))
    with contextlib.suppress(SchemaError):
        Partial.decode(bytes(payload))


# -- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "crc"),
    [
        ("", 0x00000000),
        ("a", 0xE8B7BE43),
        ("123456789", 0xCBF43926),  # the CRC-32 check value
        ("sensor-1", 0x573BDFD3),
        ("température", 0xFBB43D06),  # UTF-8 bytes, not code points
    ],
)
def test_router_is_crc32_of_utf8(key: str, crc: int) -> None:
    assert zlib.crc32(key.encode()) == crc
    for partitions in (2, 3, 7, 64):
        assert KeyRouter(partitions).partition_of(key) == crc % partitions


@pytest.mark.parametrize(
    ("key", "partitions", "partition"),
    [
        ("sensor-1", 4, 3),
        ("sensor-1", 7, 6),
        ("123456789", 64, 38),
        ("gw0-k1", 7, 3),
        ("shared-k0", 64, 49),
        (None, 7, 0),
        ("", 7, 0),
    ],
)
def test_router_pinned_partitions(key: str | None, partitions: int, partition: int) -> None:
    router = KeyRouter(partitions)
    assert router.partition_of(key) == partition
    assert router.partition_of(key) == partition  # cached answer is the same


def test_one_partition_routes_everything_to_zero() -> None:
    router = KeyRouter(1)
    assert {router.partition_of(f"k{i}") for i in range(100)} == {0}
    routed = router.route(pl.Series(["a", None, "b"]))
    assert routed.to_list() == [0, 0, 0]
    assert routed.dtype == pl.UInt16


@pytest.mark.parametrize("partitions", [2, 5, 8, 64])
def test_router_spreads_keys(partitions: int) -> None:
    router = KeyRouter(partitions)
    counts = Counter(router.partition_of(f"sensor-{i}") for i in range(20_000))
    assert set(counts) == set(range(partitions))
    expected = 20_000 / partitions
    assert all(abs(c - expected) < 0.15 * expected + 30 for c in counts.values()), counts


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.one_of(st.none(), st.text(max_size=8)), max_size=60),
    partitions=st.integers(1, 64),
)
def test_route_agrees_with_partition_of(keys: list[str | None], partitions: int) -> None:
    router = KeyRouter(partitions)
    routed = router.route(pl.Series("key", keys, dtype=pl.String))
    assert routed.dtype == pl.UInt16
    assert routed.to_list() == [KeyRouter(partitions).partition_of(k) for k in keys]


def test_route_agrees_on_a_large_series() -> None:
    keys = pl.Series("key", [f"sensor-{(i * 7919) % 5_003}" for i in range(100_000)])
    router = KeyRouter(13)
    assert router.route(keys).to_list() == [router.partition_of(k) for k in keys.to_list()]


# -- the builder -------------------------------------------------------------------------------


@pytest.mark.parametrize("partitions", [1, 2, 3, 8])
def test_one_partial_per_partition(partitions: int) -> None:
    spec = spec_of(partitions=partitions)
    builder = PartialBuilder(spec, "w1")
    router = KeyRouter(partitions)
    cases = [
        builder.build(frame_of(ROWS), info(seq=0), 5_000),
        builder.build(frame_of(ROWS[:1]), info(seq=1), 5_000),
        builder.build(frame_of([]), info(seq=2), 5_000),
        builder.rejected(info(seq=3, status="rejected", reason="bad"), 5_000),
    ]
    for partials in cases:
        assert [p.partition for p in partials] == list(range(partitions))
        assert {p.batch for p in partials} == {partials[0].batch}
        for p in partials:
            assert p.partitions == partitions
            assert p.fingerprint == spec_fingerprint(spec)
            assert p.pipeline == "p"
            assert p.produced_at_ms == 5_000
            if p.aggs is not None:
                assert router.route(p.aggs["key"]).unique().to_list() == [p.partition]
            if p.sketch is not None:
                # sketch rows point at this partial's own state rows
                assert p.aggs is not None
                assert int(p.sketch["row"].max()) < p.aggs.height  # type: ignore[arg-type]
                keys = p.aggs["key"].gather(p.sketch["row"])
                assert router.route(keys).unique().to_list() == [p.partition]


def test_build_fills_in_the_batch_range_and_counts() -> None:
    spec = spec_of()
    partials = PartialBuilder(spec, "w1").build(frame_of(ROWS), info(), 5_000)
    batch = partials[0].batch
    assert batch.rows == len(ROWS)
    assert batch.min_ts == min(r[1] for r in ROWS)
    assert batch.max_ts == max(r[1] for r in ROWS)
    assert batch.worker == "w1"
    aggs = pl.concat([p.aggs for p in partials if p.aggs is not None])
    sketch = pl.concat(
        [
            p.sketch.with_columns(window=p.aggs["window"].gather(p.sketch["row"]))
            for p in partials
            if p.sketch is not None and p.aggs is not None
        ]
    )
    for index, window in enumerate(spec.windows):
        in_window = aggs.filter(pl.col("window") == index)
        assert in_window["n"].sum() == len(ROWS) * window.windows_per_row
        assert sketch.filter(pl.col("window") == index)["count"].sum() == in_window["n"].sum()
    assert aggs["batches"].unique().to_list() == [1]
    assert aggs.group_by("window", "start", "key").len()["len"].max() == 1


def test_empty_batch_keeps_its_header() -> None:
    partials = PartialBuilder(spec_of(), "w1").build(frame_of([]), info(seq=9), 5_000)
    assert {p.batch for p in partials} == {info(seq=9)}
    assert all(p.aggs is None and p.sketch is None for p in partials)


def test_no_sketch_without_quantiles() -> None:
    spec = spec_of(aggregates=["count", "mean"], partitions=1)
    [p] = PartialBuilder(spec, "w1").build(frame_of(ROWS), info(), 5_000)
    assert p.aggs is not None
    assert p.sketch is None


def test_key_can_be_an_attribute_with_nulls() -> None:
    spec = spec_of(key="unit", partitions=4)
    frame = frame_of(ROWS).with_columns(
        unit=pl.when(pl.col("ts") % 2 == 0).then(pl.lit("C")).otherwise(None)
    )
    partials = PartialBuilder(spec, "w1").build(frame, info(), 5_000)
    aggs = pl.concat([p.aggs for p in partials if p.aggs is not None])
    assert set(aggs["key"].to_list()) == {"C", None}
    assert aggs.filter(pl.col("window") == 0)["n"].sum() == len(ROWS)


# -- fingerprints ------------------------------------------------------------------------------

BASE_FP = spec_fingerprint(spec_of())


@pytest.mark.parametrize(
    "changes",
    [
        {"windows": [{"kind": "tumbling", "size_ms": 1_000}]},
        {"windows": [{"kind": "tumbling", "size_ms": 2_000}, BASE["windows"][1]]},
        {"windows": [BASE["windows"][0], {"kind": "hopping", "size_ms": 3_000, "slide_ms": 500}]},
        {"windows": [{"kind": "tumbling", "size_ms": 1_000, "name": "x"}, BASE["windows"][1]]},
        {"windows": [*BASE["windows"], {"kind": "tumbling", "size_ms": 60_000}]},
        {"aggregates": ["count"]},
        {"aggregates": [*BASE["aggregates"], "mean"]},
        {"aggregates": [*BASE["aggregates"][:-1], "p95"]},
        {"key": "name"},
        {"sketch": {"relative_accuracy": 0.02}},
        {"partitions": 4},
    ],
)
def test_fingerprint_changes_with_what_shapes_partials(changes: dict[str, Any]) -> None:
    assert spec_fingerprint(spec_of(**changes)) != BASE_FP


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"name": "other"},
        {"inputs": ["ingest/site-1/+"]},
        {"lateness_ms": 0},
        {"idle_timeout_ms": 30_000},
        {"output_encodings": ["msgpack"]},
        {"checkpoint_interval_ms": 5_000},
        {"limits": {"max_rows": 10}},
        {"aggregates": [*BASE["aggregates"][:-2], "median", "p99"]},  # an alias of p50
    ],
)
def test_fingerprint_ignores_everything_else(changes: dict[str, Any]) -> None:
    fingerprint = spec_fingerprint(spec_of(**changes))
    assert fingerprint == BASE_FP
    assert len(fingerprint) == 12
    int(fingerprint, 16)
