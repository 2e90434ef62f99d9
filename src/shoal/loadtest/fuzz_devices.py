"""Fuzz the adapter's decoders: hostile device payloads per format, none may crash them.

``fuzz(kind, count, seed)`` feeds ``count`` payloads (random bytes, valid messages mutated by
bit flips, truncation, splicing and duplication, and hand-made hostile structures: deep
nesting, huge numbers, strings, nulls, odd timestamps, unknown aliases, unsupported
datatypes) through the same decoder the adapter uses, and reports how many were accepted
and the refusals by reason. Any exception that is not an ``InputError`` with a non-empty,
specific reason and a message naming the format is a *crash* (``shoal bench adapt --fuzz``
exits 1 on one).
"""

from __future__ import annotations

import random
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from shoal.adapters import Decoder, parse_mapping
from shoal.adapters._proto import sparkplug_b_pb2 as pb
from shoal.adapters.sparkplug import SparkplugDecoder
from shoal.errors import InputError
from shoal.loadtest.sparkplug_encode import device_message, node_birth, node_death

FUZZ_KINDS: Final = ("json", "raw", "sparkplug")
NOW_MS: Final = 1_700_000_000_000
_GENERIC: Final = frozenset({"", "invalid", "error", "unknown", "bad_input"})


@dataclass
class FuzzReport:
    """What a fuzz run saw.

    Attributes:
        kind: the format.
        payloads: fed.
        accepted: decoded into rows (some fuzz is valid).
        rows: rows they gave.
        refused: refusals by reason (whole messages and single metrics).
        crashes: anything else, with the payload (hex, cut) and the traceback's last line.
    """

    kind: str
    payloads: int = 0
    accepted: int = 0
    rows: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {
            "kind": self.kind,
            "payloads": self.payloads,
            "accepted": self.accepted,
            "rows": self.rows,
            "refused": sum(self.refused.values()),
            "refused_by_reason": dict(self.refused.most_common()),
            "crashes": len(self.crashes),
            "first_crashes": self.crashes[:5],
        }


def _mutate(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(buf)) if buf else 0
        if op == 0 and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            del buf[pos : pos + rng.randrange(1, 8)]
        elif op == 2:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        elif op == 3:
            buf = buf[: rng.randrange(len(buf) + 1)]
        else:
            buf += buf[pos:]
    return bytes(buf)


def _hostile_json(rng: random.Random) -> Any:
    pick = rng.randrange(14)
    ts = rng.choice([NOW_MS, -1, 2**63, 1.5e300, "2023-11-14T22:13:20Z", "yesterday", None, True])
    value = rng.choice([1, -0.5, 1e308, "warm", None, [1, 2], {"v": 1}, True, 2**70, ""])
    if pick == 0:
        nested: Any = 1
        for _ in range(rng.randrange(2, 3000)):
            nested = [nested] if rng.random() < 0.5 else {"a": nested}
        return nested
    if pick == 1:
        return [{"temp": value, "ts": ts} for _ in range(rng.randrange(0, 5))]
    if pick == 2:
        return {"x" * rng.randrange(1, 400): value, "ts": ts}
    if pick == 3:
        return rng.choice([None, True, 3, "text", [], {}])
    return {"temp": value, "hum": rng.choice([40, "x", None]), "ts": ts}


def _json_corpus(rng: random.Random) -> Iterator[bytes]:
    valid = orjson.dumps({"temp": 21.5, "hum": 40, "ts": NOW_MS})
    while True:
        roll = rng.random()
        if roll < 0.25:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        elif roll < 0.6:
            yield _mutate(rng, valid)
        else:
            try:
                text = orjson.dumps(_hostile_json(rng), option=orjson.OPT_PASSTHROUGH_SUBCLASS)
            except (orjson.JSONEncodeError, TypeError):
                text = b'{"temp": 1e999}'
            yield text if rng.random() < 0.8 else _mutate(rng, text)


def _raw_corpus(rng: random.Random) -> Iterator[bytes]:
    samples = [b"21.5", b"-0", b"1e999", b"nan", b"inf", b"true", b"0x10", b" 7 ", b"", b"\xff"]
    while True:
        roll = rng.random()
        if roll < 0.3:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(0, 32)))
        elif roll < 0.6:
            yield rng.choice(samples)
        else:
            yield _mutate(rng, rng.choice(samples))


def _sparkplug_corpus(rng: random.Random) -> Iterator[bytes]:
    valid = [
        node_birth(NOW_MS, 0, 1),
        device_message(0, NOW_MS, 1, 21.5, 40, birth=True),
        device_message(0, NOW_MS, 2, 22.5, -4, birth=False),
        node_death(NOW_MS, 1),
    ]
    while True:
        roll = rng.random()
        if roll < 0.2:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        elif roll < 0.6:
            yield _mutate(rng, rng.choice(valid))
        else:
            payload = pb.Payload(
                timestamp=rng.choice([NOW_MS, 0, 2**64 - 1]), seq=rng.randrange(300)
            )
            for _ in range(rng.randrange(0, 6)):
                _random_metric(rng, payload.metrics.add())
            yield payload.SerializeToString()


_SETTERS: Final[list[Callable[[random.Random, pb.Payload.Metric], None]]] = [
    lambda rng, m: setattr(m, "int_value", rng.randrange(2**32)),
    lambda rng, m: setattr(m, "long_value", rng.randrange(2**64)),
    lambda rng, m: setattr(m, "double_value", rng.choice([1.5, float("nan"), float("inf")])),
    lambda _, m: setattr(m, "string_value", "running"),
    lambda _, m: setattr(m, "boolean_value", True),
    lambda _, m: setattr(m, "is_null", True),
    lambda _, m: setattr(m, "float_value", 2.5),
    lambda _, __: None,
]


def _random_metric(rng: random.Random, metric: pb.Payload.Metric) -> None:
    if rng.random() < 0.5:
        metric.name = rng.choice(["temp", "hum", "bdSeq", "", "Node Control/Rebirth"])
    if rng.random() < 0.7:
        metric.alias = rng.randrange(8)
    metric.datatype = rng.randrange(40)
    rng.choice(_SETTERS)(rng, metric)
    if rng.random() < 0.3:
        metric.timestamp = rng.randrange(2**64)


def _decoder_for(
    kind: str,
) -> tuple[Decoder, Callable[[random.Random], tuple[str, dict[str, str]]]]:
    if kind == "json":
        route = parse_mapping(
            {
                "routes": [
                    {
                        "topic": "sensors/{site}/{device}",
                        "format": "json-object",
                        "timestamp": {"field": "ts", "unit": "ms"},
                    }
                ]
            }
        ).routes[0]
        return Decoder(route), lambda _: ("sensors/s1/d1", {"site": "s1", "device": "d1"})
    if kind == "raw":
        route = parse_mapping(
            {"routes": [{"topic": "home/{room}/{metric}", "format": "raw"}]}
        ).routes[0]
        return Decoder(route), lambda _: ("home/k/temp", {"room": "k", "metric": "temp"})
    mapping = parse_mapping({"routes": [{"topic": "spBv1.0", "format": "sparkplug"}]})
    decoder = SparkplugDecoder(mapping.routes[0])
    kinds = ["NBIRTH", "DBIRTH", "NDATA", "DDATA", "NDEATH", "DDEATH", "NCMD", "XDATA"]

    def topic(rng: random.Random) -> tuple[str, dict[str, str]]:
        message = rng.choice(kinds)
        device = "/dev0" if message.startswith("D") else ""
        text = f"spBv1.0/g/{message}/n{rng.randrange(3)}{device}"
        found = mapping.route_for(text)
        return text, found[1] if found else {}

    return decoder, topic


def fuzz(kind: str, count: int, seed: int = 0) -> FuzzReport:
    """Feed ``count`` hostile payloads of ``kind`` through the adapter's decoder."""
    rng = random.Random(seed)
    decoder, topic_of = _decoder_for(kind)
    corpus = {"json": _json_corpus, "raw": _raw_corpus, "sparkplug": _sparkplug_corpus}[kind](rng)
    report = FuzzReport(kind)
    for _ in range(count):
        payload = next(corpus)
        topic, levels = topic_of(rng)
        report.payloads += 1
        try:
            rows = decoder.decode(topic, levels, payload, NOW_MS)
            for error in decoder.take_refusals():
                _judge(report, error, kind, payload)
            report.accepted += 1
            report.rows += len(rows)
        except InputError as error:
            _judge(report, error, kind, payload)
        except Exception:  # noqa: BLE001 - exactly what the fuzz looks for
            last = traceback.format_exc().strip().splitlines()[-1]
            report.crashes.append(f"{payload[:48].hex()}: {last}")
        decoder.take_commands()
    return report


def _judge(report: FuzzReport, error: InputError, kind: str, payload: bytes) -> None:
    text = str(error)
    if error.reason in _GENERIC or not text or not text.startswith(("json", "raw", "sparkplug")):
        report.crashes.append(f"{payload[:48].hex()}: unspecific refusal {error.reason!r}: {text}")
        return
    report.refused[error.reason] += 1
    del kind
