"""Refusals say which syntax was assumed and why, what was expected, what was found, and where.

The first tests are the complaints of issue 17 item 5 as regressions: a JSON payload not
starting with ``{`` reported as MsgPack "extra data", a deeply nested MsgPack payload with an
empty reason, invalid UTF-8 as "surrogates not allowed". Then: every code the decoder can
give is in CONTRACT.md §8.1 and the other way round, and a hypothesis fuzz per encoding.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.errors import InputError
from shoal.loadtest.fuzz_decode import FORMATS, GENERIC_CODES, MUTATIONS, mutate, seeds
from shoal.schemas import DecodeLimits, decode_batch
from shoal.schemas._json import CODES as JSON_CODES
from shoal.schemas._msgpack_errors import CODES as MSGPACK_CODES

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = (ROOT / "schemas" / "CONTRACT.md").read_text("utf-8")
SOURCE = ROOT / "src" / "shoal" / "schemas"
ENVELOPE = b'{"shoal":1,"enc":"json-rows","gateway_id":"gw-7","seq":5,"sent_at":0,"rows":'
ROW = b'{"sensor_id":"t1","ts":1700000000000,"value":21.5}'


def table_codes() -> set[str]:
    section = CONTRACT.split("### 8.1 Refusal codes", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.M)) - {"code"}  # the header


def refusal(payload: bytes, **kwargs: object) -> InputError:
    with pytest.raises(InputError) as caught:
        decode_batch(payload, **kwargs)  # type: ignore[arg-type]
    return caught.value


# ------------------------------------------------------------------ the complaints


def test_a_json_array_is_read_as_json_not_as_msgpack_extra_data() -> None:
    exc = refusal(b"[" + ROW + b"]")
    assert "extra data" not in str(exc)
    assert (exc.reason, exc.code, exc.field) == ("bad_type", "bad_type", "the batch")
    assert exc.format == "JSON"
    assert exc.assumed is not None
    assert "'['" in exc.assumed
    assert exc.expected is not None
    assert "JSON object" in exc.expected
    assert exc.found == "array of 1"
    assert "[read as JSON because its first byte '['" in str(exc)


def test_plain_text_is_reported_as_invalid_json_at_byte_0() -> None:
    exc = refusal(b"temperature=21.5")
    assert (exc.reason, exc.code, exc.offset, exc.line, exc.column) == (
        "bad_json",
        "json_syntax",
        0,
        1,
        1,
    )
    assert exc.found == "'temperature=21.5'"


def test_deep_msgpack_nesting_has_a_reason_in_words() -> None:
    exc = refusal(bytes([0x91]) * 3000)
    assert exc.reason == "bad_msgpack"
    assert exc.code == "nesting_too_deep"
    assert "nested more than 1024 deep" in str(exc)
    assert exc.format == "MsgPack"


def test_invalid_utf8_in_json_names_the_byte_not_surrogates() -> None:
    payload = ENVELOPE + b'[{"sensor_id":"caf\xe9","ts":1,"value":1.0}]}'
    exc = refusal(payload)
    assert "surrogates" not in str(exc)
    assert exc.code == "invalid_utf8"
    assert exc.offset == payload.index(b"\xe9")
    assert (exc.line, exc.column) == (1, exc.offset + 1)
    assert exc.found == "byte 0xe9 (invalid continuation byte)"
    assert exc.format == "JSON"


def test_invalid_utf8_in_msgpack_names_field_row_and_byte() -> None:
    rows = [{"sensor_id": "ok", "ts": 1, "value": 1.0}, {"sensor_id": "XX", "ts": 1, "value": 2.0}]
    top = {"shoal": 1, "enc": "msgpack-rows", "gateway_id": "g", "seq": 1, "sent_at": 1}
    payload = msgpack.packb({**top, "rows": rows}).replace(b"\xa2XX", b"\xa2\xff\xfe")
    exc = refusal(payload)
    assert (exc.reason, exc.code, exc.field, exc.row) == (
        "bad_msgpack",
        "invalid_utf8",
        "sensor_id",
        1,
    )
    assert exc.offset == payload.index(b"\xff\xfe")


def test_json_syntax_errors_carry_byte_line_and_column() -> None:
    payload = ENVELOPE + b"[\n" + ROW + b",\n]}"
    exc = refusal(payload)
    assert exc.code == "json_syntax"
    assert exc.offset == payload.index(b",\n]")
    assert (exc.line, exc.column) == (2, len(ROW) + 1)
    assert exc.found == "',\\n]}'"
    assert "trailing comma" in str(exc)


def test_msgpack_extra_data_says_where_the_value_ended() -> None:
    exc = refusal(b"\x00garbage")
    assert (exc.code, exc.offset) == ("msgpack_extra_data", 1)
    assert exc.found == "int 0, then more bytes"


def test_the_content_type_and_payload_format_decide_a_payload_that_starts_oddly() -> None:
    exc = refusal(b"\x05abc", content_type="application/json")
    assert exc.format == "JSON"
    assert exc.assumed == "the content type 'application/json' says so"
    exc = refusal(b"\x05abc", payload_format=1)
    assert exc.format == "JSON"
    assert exc.assumed is not None
    assert "payload format indicator 1" in exc.assumed
    exc = refusal(b"\x05abc")
    assert exc.format == "MsgPack"


def test_a_byte_order_mark_is_named() -> None:
    exc = refusal(b"\xef\xbb\xbf" + ENVELOPE + b"[]}")
    assert (exc.code, exc.offset, exc.format) == ("json_byte_order_mark", 0, "JSON")


def test_refusals_before_the_syntax_is_chosen_name_no_format() -> None:
    assert refusal(b"").format is None
    assert refusal(b"{}", content_type="text/plain").format is None


def test_the_record_carries_the_new_keys() -> None:
    record = refusal(b"temperature=21.5").as_record()
    assert record["code"] == "json_syntax"
    assert record["format"] == "JSON"
    assert {"offset", "line", "column", "assumed", "message"} <= set(record)


# ------------------------------------------------------------------ the table


def source_reasons() -> set[str]:
    reasons = set()
    for path in SOURCE.glob("*.py"):
        reasons |= set(re.findall(r'reason="([a-z_]+)"', path.read_text("utf-8")))
    return reasons


def test_every_code_the_decoder_gives_is_in_the_table_and_the_other_way_round() -> None:
    reasons = source_reasons()
    # bad_json and bad_msgpack are families only: every refusal of theirs has a finer code.
    worker = set(
        re.findall(r'reason="([a-z_]+)"', (ROOT / "src/shoal/runtime/_batches.py").read_text())
    )
    codes = (reasons - {"bad_json", "bad_msgpack"}) | JSON_CODES | MSGPACK_CODES | worker
    assert codes == table_codes()


def test_the_code_sets_name_every_code_literal_in_their_modules() -> None:
    reasons = {
        r for p in SOURCE.glob("*.py") for r in re.findall(r'reason="([a-z_]+)"', p.read_text())
    }
    for module, codes in (("_json.py", JSON_CODES), ("_msgpack_errors.py", MSGPACK_CODES)):
        text = (SOURCE / module).read_text("utf-8")
        literals = set(re.findall(r'"([a-z]+_[a-z0-9_]+)"', text)) - reasons - {"sensor_id"}
        assert literals == codes, module


# ------------------------------------------------------------------ fuzz

TIGHT = DecodeLimits(max_payload_bytes=4096, max_rows=3, max_string_bytes=8)
SEEDS = {fmt: seeds(fmt) for fmt in FORMATS}
KNOWN = table_codes()


def check_total(payload: bytes, **kwargs: object) -> None:
    """Decodes, or is refused with a known, specific code, a message, and the syntax assumed."""
    refused: InputError | None = None
    try:
        decode_batch(payload, **kwargs)  # type: ignore[arg-type]
    except InputError as exc:
        refused = exc
    if refused is None:
        return
    assert refused.code in KNOWN, refused.code
    assert refused.code not in GENERIC_CODES, str(refused)
    assert str(refused).strip()
    if payload and refused.reason not in ("payload_too_large", "bad_content_type"):
        assert refused.format in ("JSON", "MsgPack")
        assert refused.assumed


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pick=st.integers(0, 2),
    other=st.integers(0, 2),
    kind=st.integers(0, MUTATIONS - 1),
    r=st.lists(st.floats(0, 0.999), min_size=12, max_size=12),
    tight=st.booleans(),
)
def test_mutated_payloads_of_every_encoding_are_refused_with_a_known_code(
    fmt: str, pick: int, other: int, kind: int, r: list[float], tight: bool
) -> None:
    payload = mutate(SEEDS[fmt][pick], SEEDS[fmt][other], kind, np.array(r))
    if tight:
        check_total(payload, limits=TIGHT, now_ms=1_700_000_000_500)
    else:
        check_total(payload)


@settings(max_examples=500, deadline=None)
@given(payload=st.binary(max_size=200), content_type=st.sampled_from([None, "application/json"]))
def test_random_bytes_are_refused_with_a_known_code(
    payload: bytes, content_type: str | None
) -> None:
    check_total(payload, content_type=content_type)


def test_a_timestamp_extension_with_nanoseconds_out_of_range_is_named() -> None:
    # Found by the mutation fuzz in CI: msgpack's Timestamp refuses nanoseconds > 999999999
    # with a ValueError of its own, which fell through to the unspecific msgpack_invalid.
    ts = b"\xc7\x0c\xff" + (2_000_000_000).to_bytes(4, "big") + bytes(8)  # ext8, 12 bytes, -1
    with pytest.raises(InputError) as refused:
        decode_batch(b"\x81\xa2ts" + ts)
    assert refused.value.code == "msgpack_bad_extension"
    assert "nanoseconds" in str(refused.value)


def test_a_timestamp_as_a_map_key_is_named() -> None:
    # Found by `python -m shoal.loadtest.fuzz_decode`: msgpack names the key's type with its
    # module ("datetime.datetime is not allowed for map key"), which the pattern missed.
    key = b"\xd7\xff" + bytes(8)  # fixext8, type -1: a timestamp
    with pytest.raises(InputError) as refused:
        decode_batch(b"\x81" + key + b"\x01")
    assert refused.value.code == "msgpack_map_key"
