"""The output contract: every message shoal publishes has a schema, goldens, a CONTRACT.md section.

The golden output messages decode and validate against their schemas, and running the golden
scenario again (``schemas/golden/_outputs.py``) gives exactly the committed bytes: a message
cannot change without its golden file changing, and the golden file is held to its schema.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator
from tests.support.datasets import make_batches
from tests.support.in_memory import run_in_memory

from shoal._resources import resource_dir
from shoal.processors.results import (
    Emission,
    key_messages,
    late_message,
    split_windows,
    window_json,
    window_msgpack,
)
from shoal.processors.spec import parse_pipeline
from shoal.schemas.catalog import MESSAGES, json_view, message_kind
from shoal.schemas.topics import Topics

ROOT = Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / "schemas"
GOLDEN = SCHEMAS / "golden"
OUTPUTS = GOLDEN / "outputs"
CONTRACT = (SCHEMAS / "CONTRACT.md").read_text("utf-8")
MANIFEST: dict[str, Any] = json.loads((OUTPUTS / "manifest.json").read_text("utf-8"))
ENTRIES: list[dict[str, Any]] = MANIFEST["messages"]
IDS = [e["file"].removeprefix("outputs/") for e in ENTRIES]


def _generator() -> ModuleType:
    """``schemas/golden/_outputs.py`` and ``generate_outputs.py`` (scripts, not a package)."""
    name = "shoal_golden_generate_outputs"
    if name not in sys.modules:
        sys.path.insert(0, str(GOLDEN))  # generate_outputs imports _outputs beside it
        try:
            spec = importlib.util.spec_from_file_location(name, GOLDEN / "generate_outputs.py")
            assert spec is not None
            assert spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
        finally:
            sys.path.remove(str(GOLDEN))
    return sys.modules[name]


def validator(schema_file: str) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / schema_file).read_text("utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def document(entry: dict[str, Any]) -> Any:
    payload = (GOLDEN / entry["file"]).read_bytes()
    return orjson.loads(payload) if entry["view"] is None else json_view(payload)


# -- the goldens ------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_golden_output_validates_against_its_schema(entry: dict[str, Any]) -> None:
    validator(entry["schema"]).validate(document(entry))


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_golden_output_is_on_a_topic_of_its_kind(entry: dict[str, Any]) -> None:
    payload = (GOLDEN / entry["file"]).read_bytes()
    for topics in (Topics(), Topics("site-7/a")):
        kind = message_kind(topics, topics.under_root(entry["topic"]), payload)
        assert kind is not None
        assert (kind.name, kind.schema) == (entry["kind"], entry["schema"])


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["view"]], ids=lambda e: e["view"])
def test_msgpack_golden_view_is_its_json_view(entry: dict[str, Any]) -> None:
    view = json.loads((GOLDEN / entry["view"]).read_text("utf-8"))
    assert view == json_view((GOLDEN / entry["file"]).read_bytes())


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_schemas_are_closed_and_require_what_they_describe(entry: dict[str, Any]) -> None:
    # The schemas say exactly what shoal publishes: an unknown key, or a required key
    # missing, is refused (consumers still ignore unknown keys: CONTRACT.md §13.3).
    check = validator(entry["schema"])
    doc = document(entry)
    assert not check.is_valid({**doc, "surprise": 1})
    for key in list(doc)[:3]:
        assert not check.is_valid({k: v for k, v in doc.items() if k != key}), key


def test_the_goldens_are_what_the_code_publishes_now() -> None:
    # Run the golden scenario again: the same bytes, or a message changed without its golden
    # (regenerate with schemas/golden/generate_outputs.py and review the diff).
    generate = _generator()
    cases = generate.output_cases()
    assert generate.manifest(cases) == MANIFEST
    for case in cases:
        assert (GOLDEN / case.file).read_bytes() == case.payload, case.file
        view = generate.view_file(case)
        if view is not None:
            assert (GOLDEN / view).read_text("utf-8") == generate.view_text(case), view


def test_every_output_file_is_in_the_manifest() -> None:
    listed = {e["file"] for e in ENTRIES} | {e["view"] for e in ENTRIES if e["view"]}
    on_disk = {str(p.relative_to(GOLDEN)) for p in OUTPUTS.iterdir() if p.name != "manifest.json"}
    assert on_disk == listed


# -- the catalog, the schema files and CONTRACT.md ---------------------------------------------


def test_every_kind_has_a_schema_goldens_and_a_bundled_copy() -> None:
    with_goldens = {e["kind"] for e in ENTRIES}
    for kind in MESSAGES:
        assert (SCHEMAS / kind.schema).is_file(), kind.schema
        # what an installed shoal finds (a wheel bundles schemas/; a checkout has it here)
        assert (resource_dir("schemas") / kind.schema).is_file(), kind.schema
        if kind.name != "batch":  # the batch goldens have their own manifest
            assert kind.name in with_goldens, kind.name
    on_disk = {p.name for p in SCHEMAS.glob("*.schema.json")}
    assert on_disk == {kind.schema for kind in MESSAGES}


def test_contract_index_lists_every_message_kind() -> None:
    section = CONTRACT[CONTRACT.index("## 13.") :]
    index = re.findall(
        r"^\| `([a-z-]+)` \| `([^`]+)` \|[^|]*\|[^|]*\| `([a-z-]+\.schema\.json)`", section, re.M
    )
    assert set(index) == {(m.name, m.topic, m.schema) for m in MESSAGES}
    for kind in MESSAGES:
        qos_retain = f"QoS {kind.qos}, {'retained' if kind.retain else 'not retained'}"
        assert qos_retain in section, (kind.name, qos_retain)


def test_contract_names_every_golden_output() -> None:
    for entry in ENTRIES:
        assert f"`golden/{entry['file']}`" in CONTRACT, entry["file"]


def test_contract_json_examples_are_the_goldens_they_name() -> None:
    # Each ```json block from §13 on shows the first golden its "Example (...)" names.
    section = CONTRACT[CONTRACT.index("## 13.") :]
    blocks = list(re.finditer(r"```json\n(.*?)```", section, re.S))
    assert len(blocks) >= 5
    for block in blocks:
        intro = section[section.rindex("Example (", 0, block.start()) : block.start()]
        file = re.findall(r"`golden/(outputs/[\w.-]+)`", intro)[0]
        payload = (GOLDEN / file).read_bytes()
        shown = json.loads(block.group(1))
        assert shown == (json_view(payload) if file.endswith(".msgpack") else json.loads(payload))


def test_dead_letter_reasons_of_the_worker_are_documented() -> None:
    # The codec's reasons are in §8's table (test_wire_contract_doc.py); a worker adds its own.
    source = (ROOT / "src" / "shoal" / "runtime" / "_batches.py").read_text("utf-8")
    section = CONTRACT[CONTRACT.index("## 18.") : CONTRACT.index("## 19.")]
    found = set(re.findall(r'reason="([a-z_]+)"', source))
    for reason in found | {"bad_topic", "gateway_mismatch"}:
        assert f"`{reason}`" in section, reason


def test_unknown_topics_are_no_kind() -> None:
    topics = Topics("site-7")
    for topic in ("site-7/shoal/unknown/x", "site-7/results", "elsewhere/results/p", "site-7/"):
        assert message_kind(topics, topic) is None, topic
    assert (
        message_kind(topics, "site-7/results/p/_msgpack", b"\x8c").name == "result-window-columnar"
    )
    assert message_kind(topics, "site-7/results/p/__msgpack").name == "result-key"


# -- results of other pipelines ---------------------------------------------------------------

PIPELINES = {
    "hopping-quantiles": {
        "windows": [
            {"kind": "hopping", "size_ms": 4_000, "slide_ms": 1_000},
            {"kind": "tumbling", "size_ms": 1_500, "name": "short"},
        ],
        "aggregates": ["p99.9", "median", "std", "first", "last", "max"],
        "lateness_ms": 300,
    },
    "by-attribute": {"key": "unit", "windows": [{"kind": "tumbling", "size_ms": 2_000}]},
    "partitioned": {
        "windows": [{"kind": "tumbling", "size_ms": 1_000}],
        "aggregates": ["count", "sum", "mean", "min"],
        "partitions": 3,
        "lateness_ms": 0,
    },
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_results_and_late_rows_of_any_pipeline_validate(name: str) -> None:
    spec = parse_pipeline({"name": name, "idle_timeout_ms": 100, **PIPELINES[name]})
    # Starting at 0 ms: hopping windows that cover the first rows start before the epoch.
    batches = make_batches(seed=7, gateways=2, batches_per_gateway=6, start_ms=0)
    frame, late, _ = run_in_memory(spec, batches, seed=7, workers=2)
    windows, columnar = (
        validator("result-window.schema.json"),
        validator("result-window-columnar.schema.json"),
    )
    per_key, late_schema = validator("result-key.schema.json"), validator("late.schema.json")
    results = split_windows(frame)
    assert results
    for result in results:
        ctx = Emission(spec.name, 1 % spec.partitions, spec.partitions, result.end, 5)
        windows.validate(orjson.loads(window_json(result, ctx)))
        columnar.validate(json_view(window_msgpack(result, ctx)))
        for _, payload in key_messages(result, spec.name, 5):
            per_key.validate(orjson.loads(payload))
    for rows in late:
        late_schema.validate(orjson.loads(late_message(rows, spec.name, 0, 5)))
