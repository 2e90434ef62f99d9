"""Fuzz ``decode_batch``: over 100,000 hostile payloads, each decodes or raises a typed error.

Sources, all seeded: byte-level mutations of valid payloads of every encoding (bit flips,
byte overwrites, truncations, splices, duplicated, deleted and inserted bytes); the same
mutations applied inside the envelope (rows, columns, the binary body before and after
zstd) so they reach the deeper checks; structure-aware random MsgPack and JSON documents
built from the contract's own keys and boundary values; zstd bombs; MsgPack headers that
declare huge lengths; plain noise. The decoder must return a frame with exactly
``FRAME_SCHEMA`` (and the contract's invariants) or raise ``DecodeError``/``SchemaError``
with a known reason. Anything else, or a hang (the timeout), fails the test.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import polars as pl
import pytest
import zstandard

from shoal.errors import DecodeError, SchemaError
from shoal.loadtest.data import synthetic_block
from shoal.loadtest.fuzz_decode import GENERIC_CODES, MUTATIONS, mutate
from shoal.schemas import (
    FRAME_SCHEMA,
    MAX_TS_MS,
    DecodeLimits,
    Encoding,
    decode_batch,
    encode_batch,
)

SEED = 20240611
TOTAL = 100_000
ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "schemas" / "golden"
T0 = 1_700_000_000_000
TIGHT = DecodeLimits(
    max_payload_bytes=4096, max_rows=3, max_string_bytes=8, max_decompressed_bytes=2048
)
REASONS = {
    m
    for p in (ROOT / "src" / "shoal" / "schemas").glob("_*.py")
    for m in re.findall(r'reason="([a-z_]+)"', p.read_text("utf-8"))
}


# ---------------------------------------------------------------- seeds


def seed_payloads() -> list[bytes]:
    """Valid payloads of every encoding: the golden files and encoder output with attributes."""
    manifest = json.loads((GOLDEN / "manifest.json").read_text("utf-8"))
    seeds = [(GOLDEN / e["file"]).read_bytes() for e in manifest["valid"]]
    block = synthetic_block(40, sensors=7)
    frame = block.to_frame().with_columns(
        pl.when(pl.col("value") > 25).then(pl.lit("°C")).otherwise(None).alias("unit"),
        pl.lit("temp").alias("type"),
    )
    for data in (block, frame, frame.head(1)):
        for encoding in Encoding:
            for zstd in (False, True) if encoding is Encoding.BINARY_COLUMNAR else (False,):
                payload = encode_batch(
                    data, gateway_id="gw-7", seq=5, sent_at_ms=T0, encoding=encoding, zstd=zstd
                )
                seeds.append(payload)
    return seeds


# ---------------------------------------------------------------- byte mutations


def byte_mutations(rng: np.random.Generator, seeds: list[bytes], count: int) -> Iterator[bytes]:
    """Mutations of whole payloads; parameters drawn in one vectorised call."""
    kinds = rng.integers(0, MUTATIONS, count)
    picks = rng.integers(0, len(seeds), (count, 2))
    params = rng.random((count, 12))
    for i in range(count):
        yield mutate(seeds[picks[i, 0]], seeds[picks[i, 1]], int(kinds[i]), params[i])


def inner_mutations(rng: np.random.Generator, seeds: list[bytes], count: int) -> Iterator[bytes]:
    """Mutate inside the envelope, so the outer MsgPack stays readable and deep checks run.

    For binary batches the (decompressed) body is mutated and re-compressed half the time;
    for the other MsgPack encodings a re-packed row or column list is mutated in place.
    """
    tops = [t for t in (_unpack(s) for s in seeds) if isinstance(t, dict)]
    inflate = zstandard.ZstdDecompressor()
    plain = [
        inflate.decompress(t["body"], max_output_size=2**20) if t.get("comp") == "zstd" else b""
        for t in tops
    ]
    kinds = rng.integers(0, MUTATIONS, count)
    picks = rng.integers(0, len(tops), (count, 2))
    params = rng.random((count, 12))
    for i in range(count):
        top = dict(tops[picks[i, 0]])
        r = params[i]
        kind = int(kinds[i])
        if "body" in top and isinstance(top["body"], bytes):
            body = top["body"]
            if top.get("comp") == "zstd" and r[11] < 0.5:
                body = plain[picks[i, 0]]
                top["body"] = zstandard.ZstdCompressor().compress(mutate(body, body, kind, r))
            else:
                top["body"] = mutate(body, body, kind, r)
            yield _pack(top)
        else:
            key = "rows" if "rows" in top else "cols"
            inner = _pack(top[key])
            mutated = _unpack(mutate(inner, inner, kind, r))
            top[key] = mutated if mutated is not _BROKEN else top[key]
            if r[11] < 0.3 and "n" in top:
                top["n"] = int(r[10] * 90) - 10
            yield _pack(top)


_BROKEN = object()


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any failure just means "not a usable seed"
        return _BROKEN


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# ---------------------------------------------------------------- structure-aware documents

KEYS = [
    "shoal", "enc", "gateway_id", "seq", "sent_at", "rows", "n", "cols", "comp", "body",
    "sensor_id", "ts", "value", "name", "type", "unit", "base", "dtype", "data", "dict", "codes",
    "x", "",
]  # fmt: skip
STRINGS = [
    *(e.value for e in Encoding), "none", "zstd", "u1", "u2", "u4", "i8", "f8", "f4", "gw-1",
    "", "a/b", "é" * 200, "\x00", "NaN", "1",
]  # fmt: skip
INTS = [0, 1, -1, 2, 255, 256, 65536, 2**32, T0, MAX_TS_MS, MAX_TS_MS + 1, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 1.5, 5e-324, 1.7976931348623157e308, math.nan, math.inf, -math.inf]


class Documents:
    """Random documents shaped like batches: right keys, wrong values, wrong nesting."""

    def __init__(self, rng: random.Random, *, json_safe: bool) -> None:
        self.rng = rng
        self.json_safe = json_safe

    def value(self, depth: int = 0) -> Any:
        """A random scalar or container, biased towards what the contract uses."""
        rng = self.rng
        choice = rng.randrange(12 if depth < 3 else 8)
        if choice in (0, 1):
            return rng.choice(INTS)
        if choice == 2:
            return rng.choice(FLOATS)
        if choice in (3, 4):
            return rng.choice(STRINGS)
        if choice == 5:
            return rng.choice([None, True, False])
        if choice == 6:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 24)))
        if choice == 7:
            return self.rng.choice([msgpack.ExtType(1, b"x"), msgpack.Timestamp(1, 2), 7])
        if choice in (8, 9):
            return [self.value(depth + 1) for _ in range(rng.randrange(0, 5))]
        return {rng.choice(KEYS): self.value(depth + 1) for _ in range(rng.randrange(0, 6))}

    def batch(self) -> dict[str, Any]:
        """A nearly valid top-level map of a random encoding with a few keys disturbed."""
        rng = self.rng
        enc = rng.choice(list(Encoding)).value
        top: dict[str, Any] = {
            "shoal": 1, "enc": enc, "gateway_id": "gw-1", "seq": rng.choice(INTS),
            "sent_at": T0,
        }  # fmt: skip
        n = rng.randrange(0, 4)
        if enc in ("json-rows", "msgpack-rows"):
            top["rows"] = [self.row() for _ in range(n)]
        elif enc == "msgpack-columnar":
            top["n"] = n
            rows = [self.row() for _ in range(n)]
            keys = ("sensor_id", "ts", "value", "unit")
            top["cols"] = {k: [r.get(k) for r in rows] for k in keys}
        else:
            top |= {"n": n, "comp": "none", "body": self.body(n)}
        for _ in range(rng.randrange(0, 3)):
            self.disturb(top)
        return top

    def row(self) -> dict[str, Any]:
        """A row that is valid most of the time."""
        rng = self.rng
        row: dict[str, Any] = {
            "sensor_id": rng.choice(["s1", "s2", "é"]),
            "ts": T0 + rng.randrange(1000),
            "value": rng.random() * 100,
        }
        if rng.random() < 0.3:
            row[rng.choice(["name", "type", "unit"])] = rng.choice(["x", None])
        if rng.random() < 0.3:
            self.disturb(row)
        return row

    def body(self, n: int) -> bytes | dict[str, Any]:
        """A binary body (packed) with buffers of plausible, sometimes wrong, sizes."""
        rng = self.rng
        body: dict[str, Any] = {
            "sensor_id": {"dict": ["a", "b"], "dtype": "u1",
                          "codes": bytes(rng.randrange(3) for _ in range(n))},
            "ts": {"base": rng.choice([0, T0, MAX_TS_MS]), "dtype": rng.choice(["u1", "u2", "i8"]),
                   "data": bytes(rng.randrange(256) for _ in range(n * rng.choice([1, 2, 8])))},
            "value": {"dtype": rng.choice(["f8", "f4"]),
                      "data": bytes(rng.randrange(256) for _ in range(n * rng.choice([4, 8])))},
        }  # fmt: skip
        for _ in range(rng.randrange(0, 3)):
            target = rng.choice([body, *[v for v in body.values() if isinstance(v, dict)]])
            self.disturb(target)
        if self.json_safe:
            return body
        packed = _pack(body)
        if rng.random() < 0.3:
            return zstandard.ZstdCompressor().compress(packed)
        return packed

    def disturb(self, mapping: dict[str, Any]) -> None:
        """Replace, delete or add one key."""
        rng = self.rng
        action = rng.randrange(3)
        if action == 0 and mapping:
            mapping[rng.choice(list(mapping))] = self.value()
        elif action == 1 and mapping:
            del mapping[rng.choice(list(mapping))]
        else:
            mapping[rng.choice(KEYS)] = self.value()


def random_msgpack(rng: random.Random, count: int) -> Iterator[bytes]:
    """Structure-aware MsgPack documents, and now and then an arbitrary object."""
    docs = Documents(rng, json_safe=False)
    for _ in range(count):
        obj = docs.batch() if rng.random() < 0.85 else docs.value()
        yield _pack(obj)


def random_json(rng: random.Random, count: int) -> Iterator[bytes]:
    """Structure-aware JSON documents (NaN literals included), sometimes with text damage."""
    docs = Documents(rng, json_safe=True)
    for _ in range(count):
        obj = docs.batch() if rng.random() < 0.85 else docs.value()
        text = json.dumps(obj, default=_json_default, ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.2:
            cut = rng.randrange(len(text) + 1)
            text = (
                text[:cut] + rng.choice(["", "}", "]", ",", '"', "\\", "\ud800", " "]) + text[cut:]
            )
        prefix = rng.choice(["", " ", "\n\t", "\r\n  "]) if text.startswith("{") else ""
        yield (prefix + text).encode("utf-8", "surrogatepass")


def _json_default(obj: object) -> object:
    # Bytes, extension values and timestamps have no JSON form: send them as arrays/strings.
    if isinstance(obj, bytes):
        return list(obj)
    return str(obj)


# ---------------------------------------------------------------- hostile specials


def bombs(rng: random.Random, count: int) -> Iterator[tuple[bytes, DecodeLimits]]:
    """zstd bodies that inflate far beyond the limit, declared or not, valid or damaged."""
    sized = zstandard.ZstdCompressor(level=1).compress(bytes(2**21))
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(2**21))
    top = {"shoal": 1, "enc": "binary-columnar", "gateway_id": "gw", "seq": 1, "sent_at": 0}
    for _ in range(count):
        body = rng.choice([sized, unsized])
        if rng.random() < 0.5:
            buf = bytearray(body)
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            body = bytes(buf)
        limit = rng.choice([2**20, 2**16, 1024])
        payload = _pack({**top, "n": rng.randrange(5), "comp": "zstd", "body": body})
        yield payload, DecodeLimits(max_decompressed_bytes=limit)


def huge_lengths(rng: random.Random, count: int) -> Iterator[bytes]:
    """MsgPack headers declaring up to 4 GiB of string, bin, array, map or ext."""
    heads = [b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9", b"\xda", b"\xc5", b"\xdc", b"\xde"]
    valid = _pack({"shoal": 1, "enc": "msgpack-rows", "gateway_id": "g", "seq": 1, "sent_at": 0})
    for _ in range(count):
        head = rng.choice(heads)
        width = 4 if head in heads[:5] else 2
        size = rng.choice([2 ** (8 * width) - 1, 2 ** (8 * width - 1), 1 << 20]) % 2 ** (8 * width)
        header = head + size.to_bytes(width, "big") + bytes(rng.randrange(256) for _ in range(3))
        where = rng.randrange(3)
        if where == 0:
            yield header
        elif where == 1:  # as the value of a key inside a map
            yield b"\x86" + valid[1:] + b"\xa4rows" + header
        else:
            yield valid[: rng.randrange(1, len(valid))] + header


def noise(rng: np.random.Generator, count: int) -> Iterator[bytes]:
    """Random bytes of random length, starting with every possible first byte."""
    lengths = rng.integers(1, 64, count)
    blob = rng.integers(0, 256, int(lengths.sum()), dtype=np.uint8).tobytes()
    offset = 0
    for i, n in enumerate(lengths.tolist()):
        chunk = bytes([i % 256]) + blob[offset + 1 : offset + n]
        offset += n
        yield chunk


# ---------------------------------------------------------------- the oracle


def check_frame(frame: pl.DataFrame, rows: int) -> None:
    """What the contract promises of every decoded frame."""
    assert frame.schema == FRAME_SCHEMA
    assert frame.height == rows
    if rows:
        stats = frame.select(
            pl.sum_horizontal(pl.col("sensor_id", "ts", "value").null_count()).alias("nulls"),
            pl.col("value").is_finite().all().alias("finite"),
            pl.col("ts").min().alias("lo"),
            pl.col("ts").max().alias("hi"),
        ).row(0, named=True)
        assert stats["nulls"] == 0
        assert stats["finite"]
        assert 0 <= stats["lo"] <= stats["hi"] <= MAX_TS_MS


Case = tuple[str, bytes, DecodeLimits | None]


def cases() -> Iterator[Case]:
    """Every fuzz input, labelled with its source."""
    np_rng = np.random.default_rng(SEED)
    rng = random.Random(SEED)
    seeds = seed_payloads()
    plan: list[tuple[str, Callable[[], Iterator[bytes]]]] = [
        ("bytes", lambda: byte_mutations(np_rng, seeds, 42_000)),
        ("inner", lambda: inner_mutations(np_rng, seeds, 20_000)),
        ("msgpack", lambda: random_msgpack(rng, 18_000)),
        ("json", lambda: random_json(rng, 14_000)),
        ("huge", lambda: huge_lengths(rng, 2_000)),
        ("noise", lambda: noise(np_rng, 3_500)),
    ]
    for label, source in plan:
        for i, payload in enumerate(source()):
            # One in five runs with tight limits and a clock, to reach the limit checks too.
            yield label, payload, TIGHT if i % 5 == 0 else None
    for payload, limits in bombs(rng, 500):
        yield "bomb", payload, limits


@pytest.mark.timeout(120)
def test_decode_batch_is_total_on_hostile_input() -> None:
    outcomes: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    for label, payload, limits in cases():
        try:
            if limits is None:
                batch = decode_batch(payload)
            else:
                batch = decode_batch(payload, limits=limits, now_ms=T0 + 500)
        except (DecodeError, SchemaError) as exc:
            outcomes[label, "refused"] += 1
            if exc.reason not in REASONS and len(failures) < 5:
                failures.append(f"{label}: unknown reason {exc.reason!r} for {payload[:80]!r}")
            if exc.code in GENERIC_CODES and len(failures) < 5:
                failures.append(f"{label}: unspecific refusal {exc} for {payload[:80]!r}")
            continue
        except Exception as exc:  # noqa: BLE001 - anything else is the bug being hunted
            outcomes[label, "crashed"] += 1
            if len(failures) < 5:
                failures.append(f"{label}: {type(exc).__name__}: {exc} for {payload[:200]!r}")
            continue
        outcomes[label, "decoded"] += 1
        try:
            check_frame(batch.frame, batch.envelope.rows)
        except AssertionError:
            failures.append(f"{label}: frame breaks the contract for {payload[:200]!r}")
    assert not failures, "\n".join(failures)
    assert sum(outcomes.values()) >= TOTAL
    # Every source must exercise both outcomes, or it is not testing what it claims.
    for label in ("bytes", "inner", "msgpack", "json"):
        assert outcomes[label, "decoded"] > 50, (label, outcomes)
        assert outcomes[label, "refused"] > 50, (label, outcomes)
    for label in ("huge", "noise", "bomb"):
        assert outcomes[label, "refused"] > 0, (label, outcomes)


def test_the_fuzz_corpus_is_deterministic() -> None:
    first = [p for _, p, _ in _head(cases(), 2000)]
    second = [p for _, p, _ in _head(cases(), 2000)]
    assert first == second


def _head(items: Iterator[Case], n: int) -> list[Case]:
    return [item for _, item in zip(range(n), items, strict=False)]


def test_seed_payloads_cover_every_encoding() -> None:
    found: Counter[Encoding] = Counter()
    for payload in seed_payloads():
        batch = decode_batch(payload)
        found[batch.envelope.encoding] += 1
    assert set(found) == set(Encoding)
