"""The committed golden payloads decode exactly as ``schemas/golden/manifest.json`` says.

The files are read as committed; nothing here regenerates them. A change to the codec that
breaks a golden is a change to the contract.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import polars as pl
import pytest

from shoal import errors
from shoal.schemas import FRAME_SCHEMA, DecodeLimits, Encoding, decode_batch

GOLDEN = Path(__file__).resolve().parents[3] / "schemas" / "golden"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text("utf-8"))
VALID: list[dict[str, Any]] = MANIFEST["valid"]
INVALID: list[dict[str, Any]] = MANIFEST["invalid"]
SRC = Path(__file__).resolve().parents[3] / "src" / "shoal"


def batch_reasons() -> set[str]:
    """Every ``reason`` the batch codec can raise, read from its source."""
    text = "".join(
        p.read_text("utf-8") for p in (SRC / "schemas").glob("_*.py") if p.name != "__init__.py"
    )
    return set(re.findall(r'reason="([a-z_]+)"', text))


def expected_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    return (
        pl.DataFrame(rows, schema=FRAME_SCHEMA, orient="row") if rows else FRAME_SCHEMA.to_frame()
    )


def assert_frame_exact(frame: pl.DataFrame, rows: list[dict[str, Any]]) -> None:
    """Equal column by column; values bit for bit (so -0.0 is not 0.0)."""
    assert frame.schema == FRAME_SCHEMA
    want = expected_frame(rows)
    assert frame.height == want.height
    for name in FRAME_SCHEMA.names():
        if name == "value":
            got_bits = frame.get_column(name).to_numpy().view(np.uint64)
            want_bits = want.get_column(name).to_numpy().view(np.uint64)
            assert got_bits.tolist() == want_bits.tolist()
        else:
            assert frame.get_column(name).to_list() == want.get_column(name).to_list(), name


@pytest.mark.parametrize("entry", VALID, ids=[e["file"] for e in VALID])
def test_valid_golden_decodes_to_its_expected_batch(entry: dict[str, Any]) -> None:
    payload = (GOLDEN / entry["file"]).read_bytes()
    expected = json.loads((GOLDEN / entry["expected"]).read_text("utf-8"))
    batch = decode_batch(payload, content_type=entry["content_type"])
    env = batch.envelope
    assert {
        "version": env.version,
        "encoding": env.encoding.value,
        "gateway_id": env.gateway_id,
        "seq": env.seq,
        "sent_at": env.sent_at_ms,
        "rows": env.rows,
    } == expected["envelope"]
    assert_frame_exact(batch.frame, expected["rows"])


@pytest.mark.parametrize("entry", VALID, ids=[e["file"] for e in VALID])
def test_valid_golden_detection_by_content_type(entry: dict[str, Any]) -> None:
    # Without a content type the in-band marker decides; the right vendor type agrees; any
    # other vendor type is a contradiction.
    payload = (GOLDEN / entry["file"]).read_bytes()
    encoding = Encoding(
        json.loads((GOLDEN / entry["expected"]).read_text("utf-8"))["envelope"]["encoding"]
    )
    assert decode_batch(payload).envelope.encoding is encoding
    assert decode_batch(payload, content_type=encoding.content_type).envelope.encoding is encoding
    generic = "application/json" if encoding.is_json else "application/vnd.msgpack"
    assert decode_batch(payload, content_type=generic).envelope.encoding is encoding
    for other in Encoding:
        if other is not encoding:
            with pytest.raises(errors.SchemaError) as info:
                decode_batch(payload, content_type=other.content_type)
            assert (info.value.reason, info.value.field) == ("encoding_mismatch", "enc")


@pytest.mark.parametrize("entry", INVALID, ids=[e["file"] for e in INVALID])
def test_invalid_golden_gives_exactly_its_error(entry: dict[str, Any]) -> None:
    payload = (GOLDEN / entry["file"]).read_bytes()
    with pytest.raises(errors.InputError) as info:
        decode_batch(
            payload,
            content_type=entry["content_type"],
            limits=DecodeLimits(**entry.get("limits", {})),
            now_ms=entry.get("now_ms"),
        )
    err = info.value
    assert type(err) is getattr(errors, entry["error"])
    assert (err.reason, err.field, err.row) == (entry["reason"], entry["field"], entry["row"])


def test_every_golden_file_is_in_the_manifest() -> None:
    listed = {e["file"] for e in VALID} | {e["expected"] for e in VALID}
    listed |= {e["file"] for e in INVALID}
    # outputs/ has a manifest of its own (test_output_contract.py).
    on_disk = {
        str(p.relative_to(GOLDEN))
        for p in GOLDEN.rglob("*")
        if p.is_file()
        and p.parent != GOLDEN
        and p.relative_to(GOLDEN).parts[0] not in ("__pycache__", "outputs")
    }
    assert on_disk == listed


def test_golden_covers_every_encoding_and_case() -> None:
    files = {e["file"].rsplit(".", 1)[0] for e in VALID}
    for folder in ("json-rows", "msgpack-rows", "msgpack-columnar", "binary-columnar"):
        for case in ("plain", "attributes", "empty", "unicode", "numbers", "encoder"):
            assert f"{folder}/{case}" in files
    for case in ("plain", "attributes", "empty", "unicode", "ts-i8", "values-f4", "encoder"):
        assert f"binary-columnar-zstd/{case}" in files
    for case in ("ts-u1", "ts-u2", "ts-u4", "ts-i8", "codes-u2", "codes-u4", "values-f4"):
        assert f"binary-columnar/{case}" in files


def test_golden_content_types_exercise_every_detection_path() -> None:
    kinds = {e["content_type"] for e in VALID}
    assert None in kinds
    assert {e.content_type for e in Encoding} <= kinds
    assert kinds & {"application/json"}
    assert kinds & {"application/msgpack", "application/x-msgpack"}


def test_invalid_goldens_cover_every_batch_reason() -> None:
    assert {e["reason"] for e in INVALID} == batch_reasons()


def _body(name: str) -> dict[str, Any]:
    top = msgpack.unpackb((GOLDEN / name).read_bytes())
    assert top["comp"] == "none"
    body: dict[str, Any] = msgpack.unpackb(top["body"])
    return body


@pytest.mark.parametrize(
    ("name", "column", "dtype"),
    [
        ("ts-u1", "ts", "u1"),
        ("ts-u2", "ts", "u2"),
        ("ts-u4", "ts", "u4"),
        ("ts-i8", "ts", "i8"),
        ("codes-u2", "sensor_id", "u2"),
        ("codes-u4", "sensor_id", "u4"),
        ("values-f4", "value", "f4"),
        ("plain", "value", "f8"),
    ],
)
def test_binary_goldens_use_the_layout_their_name_claims(
    name: str, column: str, dtype: str
) -> None:
    body = _body(f"binary-columnar/{name}.msgpack")
    assert body[column]["dtype"] == dtype
    if (column, dtype) == ("ts", "i8"):
        assert body["ts"]["base"] == 0
