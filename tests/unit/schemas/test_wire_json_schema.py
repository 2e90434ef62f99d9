"""The JSON Schemas agree with the codec on every golden JSON payload and control message.

Valid goldens validate; invalid goldens the manifest marks ``schema_expressible`` are refused
by the schema alone; those it marks inexpressible (limits, clocks, ``1.0`` as an integer)
validate, which pins exactly where the schema stops and the prose contract takes over.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from shoal.errors import SchemaError
from shoal.schemas.control import Confirm, GatewayStatus

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"
GOLDEN = SCHEMAS / "golden"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text("utf-8"))
JSON_VALID = [e for e in MANIFEST["valid"] if e["file"].endswith(".json")]
JSON_INVALID = [e for e in MANIFEST["invalid"] if e["file"].endswith(".json")]

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}", fullmatch=True)
SEQ = st.integers(0, 2**63 - 1)
MS = st.integers(0, 2**53 - 1)


def validator(name: str) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text("utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


BATCH = validator("batch.schema.json")
CONFIRM = validator("confirm.schema.json")
STATUS = validator("gateway-status.schema.json")


def parse(path: str) -> Any | None:
    try:
        return orjson.loads((GOLDEN / path).read_bytes())
    except orjson.JSONDecodeError:
        return None


@pytest.mark.parametrize("entry", JSON_VALID, ids=[e["file"] for e in JSON_VALID])
def test_valid_json_goldens_validate(entry: dict[str, Any]) -> None:
    BATCH.validate(parse(entry["file"]))


@pytest.mark.parametrize("entry", JSON_INVALID, ids=[e["file"] for e in JSON_INVALID])
def test_invalid_json_goldens_against_the_schema(entry: dict[str, Any]) -> None:
    doc = parse(entry["file"])
    if doc is None:
        assert "schema_expressible" not in entry  # not JSON at all: nothing to validate
        return
    assert BATCH.is_valid(doc) is not entry["schema_expressible"]


def test_some_invalid_goldens_are_schema_expressible() -> None:
    # Guards the test above against a manifest that marks nothing expressible.
    assert sum(bool(e.get("schema_expressible")) for e in JSON_INVALID) >= 15


CONFIRMS = st.builds(
    lambda gw, pipe, parts, part, seq, at, gaps: Confirm(
        gw,
        pipe,
        part % parts,
        parts,
        seq,
        at,
        tuple(sorted({seq + 1 + g for g in gaps if seq + 1 + g < 2**63})),
    ),
    NAMES,
    NAMES,
    st.integers(1, 4096),
    st.integers(0, 4095),
    st.integers(-1, 2**63 - 1),
    MS,
    st.lists(st.integers(0, 1000), max_size=6),
)


@given(CONFIRMS)
def test_confirm_messages_validate_and_round_trip(confirm: Confirm) -> None:
    payload = confirm.to_json()
    CONFIRM.validate(orjson.loads(payload))
    assert Confirm.from_json(payload) == confirm


@st.composite
def statuses(draw: st.DrawFn) -> GatewayStatus:
    next_seq = draw(SEQ)
    return GatewayStatus(
        gateway_id=draw(NAMES),
        stream=draw(NAMES),
        next_seq=next_seq,
        first_unconfirmed_seq=draw(st.integers(0, next_seq)),
        unconfirmed_batches=draw(SEQ),
        unconfirmed_rows=draw(SEQ),
        oldest_unconfirmed_ms=draw(st.none() | MS),
        spool_bytes=draw(SEQ),
        rows_total=draw(SEQ),
        at_ms=draw(MS),
    )


@given(statuses())
def test_gateway_status_messages_validate_and_round_trip(status: GatewayStatus) -> None:
    payload = status.to_json()
    STATUS.validate(orjson.loads(payload))
    assert GatewayStatus.from_json(payload) == status


GOOD_CONFIRM = orjson.loads(Confirm("gw-1", "temps", 1, 4, 41, 1_700_000_000_000).to_json())
GOOD_STATUS = orjson.loads(
    GatewayStatus("gw-1", "temps", 42, 40, 2, 2000, 1_700_000_000_000, 9000, 10**6, 1).to_json()
)

BAD_CONTROL = [
    (CONFIRM, Confirm, GOOD_CONFIRM, {"shoal": 2}, "unsupported_version", "shoal"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"shoal": True}, "unsupported_version", "shoal"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"gateway_id": "a/b"}, "bad_name", "gateway_id"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"pipeline": ""}, "bad_name", "pipeline"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"partitions": 0}, "out_of_range", "partitions"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"partition": -1}, "out_of_range", "partition"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"seq": -2}, "out_of_range", "seq"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"seq": "41"}, "bad_type", "seq"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"at": None}, "bad_type", "at"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"missing": "43"}, "bad_type", "missing"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"missing": list(range(42, 299))}, "bad_type", "missing"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"missing": [-1]}, "out_of_range", "missing"),
    (CONFIRM, Confirm, GOOD_CONFIRM, {"missing": [43.5]}, "bad_type", "missing"),
    (STATUS, GatewayStatus, GOOD_STATUS, {"stream": "a+b"}, "bad_name", "stream"),
    (STATUS, GatewayStatus, GOOD_STATUS, {"next_seq": -1}, "out_of_range", "next_seq"),
    (STATUS, GatewayStatus, GOOD_STATUS, {"spool_bytes": 1.5}, "bad_type", "spool_bytes"),
    (STATUS, GatewayStatus, GOOD_STATUS, {"oldest_unconfirmed_ms": -5}, "out_of_range",
     "oldest_unconfirmed_ms"),
    (STATUS, GatewayStatus, GOOD_STATUS, {"at_ms": 2**53}, "out_of_range", "at_ms"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "cls", "good", "change", "reason", "field"),
    BAD_CONTROL,
    ids=[f"{c[1].__name__}-{next(iter(c[3]))}-{c[4]}" for c in BAD_CONTROL],
)
def test_invalid_control_messages_are_refused_by_schema_and_decoder(
    schema: Draft202012Validator,
    cls: type[Confirm] | type[GatewayStatus],
    good: dict[str, Any],
    change: dict[str, Any],
    reason: str,
    field: str,
) -> None:
    schema.validate(good)
    doc = {**good, **change}
    assert not schema.is_valid(doc)
    with pytest.raises(SchemaError) as info:
        cls.from_json(orjson.dumps(doc))
    assert (info.value.reason, info.value.field) == (reason, field)


def test_cross_field_control_rules_are_beyond_the_schema() -> None:
    # partition < partitions and first_unconfirmed_seq <= next_seq are prose-only rules.
    confirm = {**GOOD_CONFIRM, "partition": 4, "partitions": 4}
    assert CONFIRM.is_valid(confirm)
    with pytest.raises(SchemaError) as info:
        Confirm.from_json(orjson.dumps(confirm))
    assert (info.value.reason, info.value.field) == ("out_of_range", "partition")
    for missing in ([41], [44, 43], [43, 43]):  # above seq (41), strictly ascending
        confirm = {**GOOD_CONFIRM, "missing": missing}
        assert CONFIRM.is_valid(confirm)
        with pytest.raises(SchemaError) as info:
            Confirm.from_json(orjson.dumps(confirm))
        assert info.value.field == "missing"
    status = {**GOOD_STATUS, "first_unconfirmed_seq": 43}
    assert STATUS.is_valid(status)
    with pytest.raises(SchemaError) as info:
        GatewayStatus.from_json(orjson.dumps(status))
    assert (info.value.reason, info.value.field) == ("out_of_range", "first_unconfirmed_seq")
