"""Hostile input for a running worker, generated fast and reproducibly, plus good batches.

Four sources, mixed by ``hostile_stream``:

* ``structured`` — well-framed batches of every encoding with one defect each (NaN/inf,
  timestamps far in the future or the past, out of range, wrong types, nulls, empty or
  over-long ids, missing/unknown fields, length mismatches, bad dtypes and dictionary codes,
  unknown encodings or versions, content types that lie, too many rows with a distinct key
  each, zstd bombs, oversized payloads). Their envelope stays readable, so they are published
  under their own gateway's topic (``bad-<k>``, contiguous seqs) and the worker marks each seq
  as handled; anything whose envelope the worker could not read goes to a ``junk`` topic.
* ``mutation`` — byte-level mutations (bit flips, overwrites, truncations, splices,
  duplicated, deleted or inserted bytes) of valid payloads of every encoding, and the same
  inside the envelope (rows, columns, the binary body before and after zstd);
* ``hypothesis`` — documents drawn by hypothesis strategies: contract keys with random values
  and nesting, random bytes and text, under random content types;
* ``mqtt`` — empty payloads, nesting bombs, MsgPack headers declaring huge lengths, text.

Everything but ``structured`` is published under ``junk-<k>`` topics while naming another
gateway inside: whatever the bytes are, the worker must refuse them (at worst as
``gateway_mismatch``) and never mark a seq. ``good_batches`` are valid batches of known content
from a few gateways (one of them with tens of thousands of distinct keys per batch).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import orjson
import polars as pl
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shoal.errors import InputError
from shoal.schemas import DecodeLimits, Encoding, decode_batch, encode_batch, peek_envelope

BAD_GATEWAYS = 4
JUNK_TOPICS = 4
SOURCE_GATEWAY = "bad-src"
"""The gateway id inside mutated payloads: never the gateway of the topic they arrive on."""

CONTENT_TYPES = [e.content_type for e in Encoding] + [None, "text/plain", "application/json"]
SPECIAL_EVERY = 300
"""Every this many structured payloads, an expensive one: too many rows, oversized, lying."""


@dataclass(frozen=True, slots=True)
class Bad:
    """One hostile message.

    Attributes:
        topic_gateway: the gateway segment of the ingest topic it is published under.
        payload: its bytes.
        content_type: its MQTT 5 content type (None: none, the in-band marker decides).
        source: which generator made it.
        marked: its envelope names its topic's gateway (bad-<k>, seq): the worker marks it.
        reason: the reason a local decode with the same limits gives (``structured`` only).
    """

    topic_gateway: str
    payload: bytes
    content_type: str | None
    source: str
    marked: bool = False
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Good:
    """One valid batch and the rows it carries (gateway_id, seq, key, ts, value)."""

    gateway_id: str
    seq: int
    payload: bytes
    content_type: str | None
    rows: pl.DataFrame


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# -- good batches ---------------------------------------------------------------------------------


def good_batches(
    *,
    base_ms: int,
    gateways: int,
    batches: int,
    rows: int,
    wide_batches: int,
    wide_keys: int,
    seed: int,
) -> list[Good]:
    """Valid batches of every encoding, in seq order per gateway; ``wide-0`` has one distinct
    key per row."""
    rng = np.random.default_rng(seed)
    encodings = list(Encoding)
    out: list[Good] = []
    for g in range(gateways):
        gateway_id = f"good-{g}"
        ts = base_ms + g * 3
        for seq in range(batches):
            stamps = ts + np.sort(rng.integers(0, 40 * rows, rows))
            ts = int(stamps[-1]) + 1
            frame = pl.DataFrame(
                {
                    "sensor_id": [f"{gateway_id}-s{i}" for i in rng.integers(0, 25, rows)],
                    "ts": stamps.astype(np.int64),
                    "value": np.round(rng.normal(20.0, 5.0, rows), 3),
                }
            )
            encoding = encodings[(g + seq) % len(encodings)]
            zstd = encoding is Encoding.BINARY_COLUMNAR and seq % 2 == 0
            out.append(_good(gateway_id, seq, frame, encoding, zstd, in_band=seq % 5 == 4))
    ts = base_ms
    for seq in range(wide_batches):
        stamps = ts + np.arange(wide_keys, dtype=np.int64) // 50
        ts = int(stamps[-1]) + 1
        frame = pl.DataFrame(
            {
                "sensor_id": [f"wide-{seq}-{i}" for i in range(wide_keys)],
                "ts": stamps,
                "value": rng.random(wide_keys),
            }
        )
        out.append(_good("wide-0", seq, frame, Encoding.BINARY_COLUMNAR, False, in_band=False))
    return out


def _good(
    gateway_id: str,
    seq: int,
    frame: pl.DataFrame,
    encoding: Encoding,
    zstd: bool,
    *,
    in_band: bool,
) -> Good:
    payload = encode_batch(
        frame, gateway_id=gateway_id, seq=seq, sent_at_ms=0, encoding=encoding, zstd=zstd
    )
    rows = frame.select(
        pl.lit(gateway_id).alias("gateway_id"),
        pl.lit(seq).alias("seq"),
        pl.col("sensor_id").alias("key"),
        "ts",
        "value",
    )
    # Some travel without a content type, as from an MQTT 3.1.1 gateway: the in-band marker.
    return Good(gateway_id, seq, payload, None if in_band else encoding.content_type, rows)


# -- structured defects -------------------------------------------------------------------------


def _rows(now_ms: int, n: int = 3) -> list[dict[str, Any]]:
    return [
        {"sensor_id": f"s{i}", "ts": now_ms - 3_600_000 + i, "value": 20.0 + i} for i in range(n)
    ]


def _envelope(encoding: str, gateway_id: str, seq: int) -> dict[str, Any]:
    return {"shoal": 1, "enc": encoding, "gateway_id": gateway_id, "seq": seq, "sent_at": 0}


ROW_DEFECTS: dict[str, Callable[[dict[str, Any], int], None]] = {
    "nan": lambda r, now: r.update(value=math.nan),
    "inf": lambda r, now: r.update(value=math.inf),
    "-inf": lambda r, now: r.update(value=-math.inf),
    "future": lambda r, now: r.update(ts=now + 86_400_000),
    "ancient": lambda r, now: r.update(ts=631_152_000_000),  # 1990
    "negative_ts": lambda r, now: r.update(ts=-5),
    "huge_ts": lambda r, now: r.update(ts=2**62),
    "value_str": lambda r, now: r.update(value="12.5"),
    "value_bool": lambda r, now: r.update(value=True),
    "ts_float": lambda r, now: r.update(ts=float(r["ts"])),
    "id_int": lambda r, now: r.update(sensor_id=42),
    "id_empty": lambda r, now: r.update(sensor_id=""),
    "id_long": lambda r, now: r.update(sensor_id="x" * 300),
    "id_nul": lambda r, now: r.update(sensor_id="a\x00b"),
    "null_ts": lambda r, now: r.update(ts=None),
    "null_value": lambda r, now: r.update(value=None),
    "missing_value": lambda r, now: r.pop("value"),
    "unknown_field": lambda r, now: r.update(colour="red"),
    "unit_int": lambda r, now: r.update(unit=7),
}

ENVELOPE_DEFECTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "version": lambda e: e.update(shoal=2),
    "version_str": lambda e: e.update(shoal="1"),
    "enc_unknown": lambda e: e.update(enc="xml-rows"),
    "rows_map": lambda e: e.update(rows={"a": 1}, cols={"a": 1}),
    "n_mismatch": lambda e: e.update(n=5),
    "extra_key": lambda e: e.update(extra=[1, 2, 3]),
    "sent_at_str": lambda e: e.update(sent_at="yesterday"),
}


def _rows_payload(
    encoding: Encoding, envelope: dict[str, Any], rows: list[dict[str, Any]]
) -> bytes:
    if encoding is Encoding.JSON_ROWS:
        return json.dumps({**envelope, "rows": rows}, allow_nan=True).encode()
    if encoding is Encoding.MSGPACK_ROWS:
        return _pack({**envelope, "rows": rows})
    keys = sorted({k for row in rows for k in row})
    cols = {k: [row.get(k) for row in rows] for k in keys}
    return _pack({**envelope, "n": len(rows), "cols": cols})


def _binary_variants(
    gateway_id: str, seq: int, now_ms: int, rng: random.Random
) -> tuple[str, bytes]:
    """A binary-columnar payload with one defect in or around its body."""
    frame = pl.DataFrame(_rows(now_ms, 4))
    top = msgpack.unpackb(
        encode_batch(
            frame, gateway_id=gateway_id, seq=seq, sent_at_ms=0, encoding=Encoding.BINARY_COLUMNAR
        ),
        raw=False,
    )
    body = msgpack.unpackb(top["body"], raw=False)
    kind = rng.choice(["dtype", "code", "short", "base", "bomb", "comp", "dict_nul", "noise"])
    if kind == "dtype":
        body["value"]["dtype"] = "f3"
    elif kind == "code":
        body["sensor_id"]["codes"] = bytes([0, 1, 2, 250])
    elif kind == "short":
        body["value"]["data"] = body["value"]["data"][:-3]
    elif kind == "base":
        body["ts"]["base"] = -(2**62)
    elif kind == "dict_nul":
        body["sensor_id"]["dict"] = ["", "b", "c", "d"]
    elif kind == "noise":
        body = {"ts": 1, "value": None, "sensor_id": [1, 2]}
    if kind == "bomb":
        # 9 MiB of zeros in a few hundred bytes: must stop at max_decompressed_bytes.
        top["comp"] = "zstd"
        top["body"] = _zstd_bomb()
    elif kind == "comp":
        top["comp"] = "lz4"
    else:
        top["body"] = _pack(body)
    return kind, _pack(top)


@functools.cache
def _zstd_bomb() -> bytes:
    return zstandard.ZstdCompressor(level=19).compress(b"\x00" * (9 * 2**20))


def structured(count: int, now_ms: int, limits: DecodeLimits, rng: random.Random) -> Iterator[Bad]:
    """``count`` batches with one defect each (see the module docstring)."""
    seqs = dict.fromkeys(range(BAD_GATEWAYS), 0)
    rows_encodings = [Encoding.JSON_ROWS, Encoding.MSGPACK_ROWS, Encoding.MSGPACK_COLUMNAR]
    specials = ["too_many_rows", "oversized", "lying_type"]
    for i in range(count):
        k = i % BAD_GATEWAYS
        gateway_id, seq = f"bad-{k}", seqs[k]
        content_type: str | None
        roll = rng.random()
        if i % SPECIAL_EVERY == SPECIAL_EVERY - 1:
            kind = specials[(i // SPECIAL_EVERY) % len(specials)]
            payload, content_type = _special(kind, gateway_id, seq, now_ms, limits)
        elif roll < 0.18:
            kind, payload = _binary_variants(gateway_id, seq, now_ms, rng)
            content_type = Encoding.BINARY_COLUMNAR.content_type
        else:
            encoding = rng.choice(rows_encodings)
            envelope = _envelope(encoding.value, gateway_id, seq)
            rows = _rows(now_ms, rng.randint(1, 4))
            if rng.random() < 0.8:
                kind = rng.choice(list(ROW_DEFECTS))
                ROW_DEFECTS[kind](rows[rng.randrange(len(rows))], now_ms)
            else:
                kind = rng.choice(list(ENVELOPE_DEFECTS))
                ENVELOPE_DEFECTS[kind](envelope)
            payload = _rows_payload(encoding, envelope, rows)
            content_type = encoding.content_type
        reason = _local_reason(payload, content_type, limits, now_ms)
        if reason is None:
            continue  # the defect happened to be harmless: not a bad payload
        marked = peek_envelope(payload, limits) == (gateway_id, seq)
        if marked:
            seqs[k] += 1
        yield Bad(
            gateway_id if marked else f"junk-{k}",
            payload,
            content_type,
            f"structured:{kind}",
            marked=marked,
            reason=reason,
        )


def _special(
    kind: str, gateway_id: str, seq: int, now_ms: int, limits: DecodeLimits
) -> tuple[bytes, str | None]:
    if kind == "too_many_rows":
        # One distinct key per row, one row more than allowed.
        n = limits.max_rows + 1
        frame = pl.DataFrame(
            {
                "sensor_id": [f"card-{i}" for i in range(n)],
                "ts": np.full(n, now_ms - 60_000, dtype=np.int64),
                "value": np.zeros(n),
            }
        )
        payload = encode_batch(
            frame, gateway_id=gateway_id, seq=seq, sent_at_ms=0, encoding=Encoding.BINARY_COLUMNAR
        )
        return payload, Encoding.BINARY_COLUMNAR.content_type
    if kind == "oversized":
        envelope = _envelope("msgpack-rows", gateway_id, seq)
        envelope["rows"] = _rows(now_ms)
        envelope["pad"] = b"\x00" * (limits.max_payload_bytes + 1024)
        return _pack(envelope), Encoding.MSGPACK_ROWS.content_type
    # A JSON batch announced as MsgPack.
    frame = pl.DataFrame(_rows(now_ms))
    payload = encode_batch(
        frame, gateway_id=gateway_id, seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS
    )
    return payload, Encoding.MSGPACK_ROWS.content_type


def _local_reason(
    payload: bytes, content_type: str | None, limits: DecodeLimits, now_ms: int
) -> str | None:
    try:
        decode_batch(payload, content_type=content_type, limits=limits, now_ms=now_ms)
    except InputError as exc:
        return exc.reason
    return None


# -- mutations ------------------------------------------------------------------------------------


def seed_payloads(now_ms: int) -> list[tuple[bytes, str]]:
    """Valid payloads of every encoding (and zstd), naming ``SOURCE_GATEWAY``."""
    frame = pl.DataFrame(_rows(now_ms, 12)).with_columns(
        pl.lit("degC").alias("unit"), pl.lit("temperature").alias("type")
    )
    out = []
    for encoding in Encoding:
        for zstd in (False, True) if encoding is Encoding.BINARY_COLUMNAR else (False,):
            for rows in (frame, frame.head(1)):
                payload = encode_batch(
                    rows,
                    gateway_id=SOURCE_GATEWAY,
                    seq=7,
                    sent_at_ms=0,
                    encoding=encoding,
                    zstd=zstd,
                )
                out.append((payload, encoding.content_type))
    return out


def _mutate(data: bytes, other: bytes, kind: int, r: np.ndarray) -> bytes:
    n = max(len(data), 1)
    at = int(r[0] * n)
    if kind == 0:  # flip up to eight bits
        buf = bytearray(data)
        for j in range(1 + int(r[1] * 8)):
            if buf:
                buf[int(r[2 + j] * len(buf))] ^= 1 << int(r[3 + j] * 8) % 8
        return bytes(buf)
    if kind == 1:  # overwrite a byte with a MsgPack/JSON-significant value
        value = [0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xDD, 0xDF, 0xC6, 0xDB, 0x7B, 0x22][
            int(r[1] * 12)
        ]
        return data[:at] + bytes([value]) + data[at + 1 :]
    if kind == 2:  # truncate
        return data[:at]
    if kind == 3:  # splice two payloads
        return data[:at] + other[int(r[1] * len(other)) :]
    if kind == 4:  # duplicate a slice
        end = at + 1 + int(r[1] * 32)
        return data[:end] + data[at:end] + data[end:]
    if kind == 5:  # delete a slice
        return data[:at] + data[at + 1 + int(r[1] * 32) :]
    noise = bytes(int(x * 256) for x in r[1 : 2 + int(r[2] * 8)])
    return data[:at] + noise + data[at:]


def mutations(count: int, now_ms: int, np_rng: np.random.Generator) -> Iterator[Bad]:
    """Byte-level and inside-the-envelope mutations of valid payloads."""
    seeds = seed_payloads(now_ms)
    tops = [msgpack.unpackb(p, raw=False) for p, _ in seeds if p[:1] != b"{"]
    kinds = np_rng.integers(0, 7, count)
    picks = np_rng.integers(0, len(seeds), (count, 2))
    params = np_rng.random((count, 14))
    inflate = zstandard.ZstdDecompressor()
    deflate = zstandard.ZstdCompressor()
    for i in range(count):
        r = params[i]
        payload, content_type = seeds[picks[i, 0]]
        if r[12] < 0.6:
            mutated = _mutate(payload, seeds[picks[i, 1]][0], int(kinds[i]), r)
            source = "mutation:bytes"
        else:
            top = dict(tops[picks[i, 0] % len(tops)])
            if "body" in top:
                body = top["body"]
                if top.get("comp") == "zstd" and r[11] < 0.5:
                    plain = inflate.decompress(body)
                    top["body"] = deflate.compress(_mutate(plain, plain, int(kinds[i]), r))
                else:
                    top["body"] = _mutate(body, body, int(kinds[i]), r)
            else:
                key = "rows" if "rows" in top else "cols"
                inner = _pack(top[key])
                try:
                    top[key] = msgpack.unpackb(
                        _mutate(inner, inner, int(kinds[i]), r), raw=False, strict_map_key=False
                    )
                except Exception:  # noqa: BLE001 - an unreadable mutation: keep the raw bytes
                    top[key] = _mutate(inner, inner, int(kinds[i]), r)
            mutated = _pack(top)
            source = "mutation:inner"
        if r[13] < 0.15:
            content_type = CONTENT_TYPES[int(r[13] * 100) % len(CONTENT_TYPES)]
        yield Bad(f"junk-{i % JUNK_TOPICS}", mutated, content_type, source)


# -- hypothesis -----------------------------------------------------------------------------------

KEYS = [
    "shoal", "enc", "gateway_id", "seq", "sent_at", "rows", "n", "cols", "comp", "body",
    "sensor_id", "ts", "value", "name", "type", "unit", "base", "dtype", "data", "dict", "codes",
]  # fmt: skip
ENCODING_NAMES = [e.value for e in Encoding]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from([*ENCODING_NAMES, "none", "zstd", "u1", "f8", SOURCE_GATEWAY])
    | st.binary(max_size=24)
)
_documents = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), children, max_size=7)
    ),
    max_leaves=24,
)
_shaped = st.fixed_dictionaries(
    {
        "shoal": st.sampled_from([1, 1, 1, 2, True, "1"]),
        "enc": st.sampled_from([*ENCODING_NAMES, "nope"]),
        "gateway_id": st.sampled_from([SOURCE_GATEWAY, "", "a/b", "x" * 200]),
        "seq": st.integers(min_value=-3, max_value=2**64 - 1),
        "sent_at": st.integers(min_value=0, max_value=2**50),
    },
    optional={"rows": _documents, "cols": _documents, "n": _documents, "body": _documents},
)


def hypothesis_payloads(count: int, seed: int) -> list[Bad]:
    """``count`` payloads drawn by hypothesis (deterministic for a seed)."""
    out: list[Bad] = []
    picker = random.Random(seed)

    @settings(
        max_examples=count,
        database=None,
        derandomize=True,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(_shaped, _documents, st.binary(max_size=200)))
    def collect(document: Any) -> None:
        if isinstance(document, bytes):
            payload = document
        elif picker.random() < 0.3:
            try:
                payload = json.dumps(document, allow_nan=True, default=repr).encode()
            except (TypeError, ValueError):
                payload = _pack(document)
        else:
            payload = _pack(document)
        content_type = picker.choice(CONTENT_TYPES)
        out.append(Bad(f"junk-{len(out) % JUNK_TOPICS}", payload, content_type, "hypothesis"))

    while len(out) < count:
        collect()
    return out[:count]


# -- MQTT-level oddities --------------------------------------------------------------------------


def oddities(count: int, rng: random.Random) -> Iterator[Bad]:
    """Empty payloads, nesting bombs, huge declared lengths, text."""
    makers: list[Callable[[], bytes]] = [
        lambda: b"",
        lambda: b"\x91" * 100_000 + b"\xc0",  # 100,000 nested one-element arrays
        lambda: b"[" * 50_000 + b"]" * 50_000,
        lambda: b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion elements
        lambda: b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
        lambda: b"\xc6\xff\xff\xff\xf0" + b"x" * 10,  # bin32 claiming 4 GiB
        lambda: orjson.dumps({"shoal": 1, "enc": "json-rows", "rows": []})[:-1] * 3,
        lambda: bytes("καλημέρα 🌊 \u0000 \ud7ff", "utf-8"),
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))),
    ]
    for i in range(count):
        payload = makers[i % len(makers)]()
        yield Bad(f"junk-{i % JUNK_TOPICS}", payload, rng.choice(CONTENT_TYPES), "mqtt")


def hostile_stream(total: int, now_ms: int, limits: DecodeLimits, seed: int) -> list[Bad]:
    """``total`` hostile payloads: 25 % structured, 60 % mutations, 10 % hypothesis, 5 % odd."""
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    n_struct, n_hyp, n_odd = total // 4, total // 10, total // 20
    bad = list(structured(n_struct, now_ms, limits, rng))
    bad += list(oddities(n_odd, rng))
    bad += hypothesis_payloads(n_hyp, seed)
    bad += list(mutations(total - len(bad), now_ms, np_rng))
    marked = [b for b in bad if b.marked]
    rest = [b for b in bad if not b.marked]
    rng.shuffle(rest)
    # Marked ones keep their per-gateway seq order; spread them evenly through the rest.
    step = max(1, len(rest) // max(1, len(marked)))
    out: list[Bad] = []
    for i, item in enumerate(rest):
        if i % step == 0 and marked:
            out.append(marked.pop(0))
        out.append(item)
    return out + marked
