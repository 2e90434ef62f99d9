"""Fuzz the batch decoder per encoding and count its refusals by code; prints JSON.

``python -m shoal.loadtest.fuzz_decode --count 100000`` feeds ``count`` payloads per encoding
(mutated valid batches and the mistakes devices make: a JSON array, a byte-order mark,
Latin-1 text, ``NaN``, deep nesting, strings for numbers) to ``decode_batch`` and checks that
every payload either decodes or is refused with an ``InputError`` whose code is specific (not
the catch-all) and whose message is non-empty. Exits 1 if any payload crashed the decoder or
was refused without a specific reason. A tool beside the product: nothing in shoal imports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import orjson
import polars as pl

from shoal.errors import InputError
from shoal.loadtest.data import synthetic_block
from shoal.schemas import DecodeLimits, Encoding, decode_batch, encode_batch

T0: Final = 1_700_000_000_000
GENERIC_CODES: Final = frozenset({"msgpack_invalid"})
"""Codes that mean "the decoder could not say more": a fuzz finding, not a pass."""
TIGHT: Final = DecodeLimits(
    max_payload_bytes=4096, max_rows=3, max_string_bytes=8, max_decompressed_bytes=2048
)
FORMATS: Final = ("json-rows", "msgpack-rows", "msgpack-columnar", "binary-columnar", "zstd")
MUTATIONS: Final = 7


def mutate(data: bytes, other: bytes, kind: int, r: npt.NDArray[np.float64]) -> bytes:
    """Apply mutation ``kind`` (0..6) using the random numbers ``r`` (12 floats in [0, 1))."""
    n = len(data)
    at = int(r[0] * n)
    if kind == 0:  # flip one to eight bits
        buf = bytearray(data)
        for k in range(1 + int(r[1] * 8)):
            pos = int(r[(2 + k) % len(r)] * n)
            buf[pos] ^= 1 << int(r[(3 + k) % len(r)] * 8)
        return bytes(buf)
    if kind == 1:  # overwrite a byte with an interesting value
        value = [0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xDD, 0xDF, 0xC6, 0xDB][int(r[1] * 10)]
        return data[:at] + bytes([value]) + data[at + 1 :]
    if kind == 2:  # truncate
        return data[:at]
    if kind == 3:  # splice: a prefix of one payload, a suffix of another
        return data[:at] + other[int(r[1] * len(other)) :]
    if kind == 4:  # duplicate a slice
        end = at + 1 + int(r[1] * 16)
        return data[:end] + data[at:end] + data[end:]
    if kind == 5:  # delete a slice
        return data[:at] + data[at + 1 + int(r[1] * 16) :]
    # insert random bytes
    noise = bytes(int(x * 256) for x in r[1 : 1 + int(r[2] * 6) + 1])
    return data[:at] + noise + data[at:]


def seeds(fmt: str) -> list[bytes]:
    """Valid payloads of one format (``FORMATS``), with and without attributes."""
    encoding = Encoding.BINARY_COLUMNAR if fmt == "zstd" else Encoding(fmt)
    block = synthetic_block(12, sensors=5)
    frame = block.to_frame().with_columns(
        pl.when(pl.col("value") > 25).then(pl.lit("°C")).otherwise(None).alias("unit")
    )
    return [
        encode_batch(
            data, gateway_id="gw-7", seq=5, sent_at_ms=T0, encoding=encoding, zstd=fmt == "zstd"
        )
        for data in (block, frame, frame.head(1))
    ]


def device_mistakes(fmt: str) -> list[bytes]:
    """What devices get wrong, in the spirit of the format (text mistakes for JSON)."""
    if fmt != "json-rows":
        return [bytes([0x91]) * 3000, b"\x05" + seeds(fmt)[0], seeds(fmt)[0] + b"\x00"]
    row = b'{"sensor_id":"t1","ts":1700000000000,"value":21.5}'
    envelope = b'{"shoal":1,"enc":"json-rows","gateway_id":"gw-7","seq":5,"sent_at":0,"rows":'
    return [
        b"[" + row + b"]",
        b"\xef\xbb\xbf" + envelope + b"[" + row + b"]}",
        envelope + b'[{"sensor_id":"caf\xe9","ts":1,"value":1.0}]}',
        envelope + b'[{"sensor_id":"t1","ts":1,"value":NaN}]}',
        envelope + b'[{"sensor_id":"t1","ts":"1700000000000","value":1.0}]}',
        envelope + b"[" + b"[" * 2000 + b"]}",
        b"temperature=21.5",
    ]


def payloads(fmt: str, count: int, seed: int) -> Iterator[bytes]:
    """``count`` fuzz payloads of one format: its device mistakes, then mutations."""
    valid = seeds(fmt)
    mistakes = device_mistakes(fmt)
    base = valid + mistakes
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, MUTATIONS, count)
    picks = rng.integers(0, len(base), (count, 2))
    params = rng.random((count, 12))
    for i in range(count):
        if i < len(mistakes):
            yield mistakes[i]
        else:
            yield mutate(base[picks[i, 0]], base[picks[i, 1]], int(kinds[i]), params[i])


def fuzz_format(fmt: str, count: int, seed: int) -> dict[str, object]:
    """Decode ``count`` payloads of ``fmt``; the tally, and up to five failures."""
    codes: Counter[str] = Counter()
    decoded = crashed = unspecific = 0
    failures: list[str] = []
    started = time.monotonic()
    for i, payload in enumerate(payloads(fmt, count, seed)):
        try:
            if i % 5 == 0:  # one in five with tight limits and a clock, to reach those checks
                decode_batch(payload, limits=TIGHT, now_ms=T0 + 500)
            else:
                decode_batch(payload)
        except InputError as exc:
            codes[exc.code] += 1
            if exc.code in GENERIC_CODES or not str(exc) or not exc.code:
                unspecific += 1
                if len(failures) < 5:
                    failures.append(f"unspecific {exc.code!r}: {exc} for {payload[:80]!r}")
            continue
        except Exception as exc:  # noqa: BLE001 - anything else is the bug being hunted
            crashed += 1
            if len(failures) < 5:
                failures.append(f"{type(exc).__name__}: {exc} for {payload[:80]!r}")
            continue
        decoded += 1
    return {
        "format": fmt,
        "payloads": count,
        "decoded": decoded,
        "refused": sum(codes.values()),
        "crashed": crashed,
        "unspecific": unspecific,
        "seconds": round(time.monotonic() - started, 2),
        "codes": dict(codes.most_common()),
        "failures": failures,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fuzz and print the JSON report; 0 if nothing crashed and every code was specific."""
    parser = argparse.ArgumentParser(
        prog="python -m shoal.loadtest.fuzz_decode", description=__doc__
    )
    parser.add_argument("--count", type=int, default=100_000, help="payloads per format")
    parser.add_argument("--seed", type=int, default=17, help="random seed (default 17)")
    parser.add_argument(
        "--format", action="append", choices=FORMATS, help="only these formats (default all)"
    )
    args = parser.parse_args(argv)
    results = [
        fuzz_format(fmt, args.count, args.seed + i) for i, fmt in enumerate(args.format or FORMATS)
    ]
    ok = all(r["crashed"] == 0 and r["unspecific"] == 0 for r in results)
    sys.stdout.write(
        orjson.dumps({"ok": ok, "formats": results}, option=orjson.OPT_INDENT_2).decode()
    )
    sys.stdout.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
