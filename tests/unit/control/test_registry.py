"""The control plane's pure core: canonical specs, hashes, and every refusal of issue 15 item 7."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shoal.control.canonical import (
    CanonicalSpec,
    canonical_mapping,
    canonicalize,
    canonicalize_toml,
)
from shoal.control.messages import PipelineDocument, Request, Result
from shoal.control.registry import Registry, refuse_unreadable
from shoal.errors import ControlError
from shoal.processors.spec import load_pipeline, parse_pipeline

PROCESSORS = Path(__file__).parents[3] / "processors"

SPEC = """
name = "temps"
aggregates = ["count", "avg", "p95"]
[[windows]]
size_ms = 10000
"""
SAME_ELSEWHERE = """
# the same computation, written differently, under another name
aggregates = ["COUNT", "mean", "p95"]
name = "temps-2"
lateness_ms = 2000
[[windows]]
kind = "tumbling"
name = "tumbling-10s"
size_ms = 10000
"""
CHANGED = SPEC.replace("10000", "5000")


@pytest.mark.parametrize("path", sorted(PROCESSORS.glob("*.toml")), ids=lambda p: p.stem)
def test_the_canonical_form_is_a_spec_that_parses_to_the_same_pipeline(path: Path) -> None:
    spec = load_pipeline(path)
    again = parse_pipeline(canonical_mapping(spec))
    assert again == parse_pipeline(canonical_mapping(again))
    assert again == dataclasses.replace(spec, source=None)


def test_the_canonical_form_keeps_the_future_policy() -> None:
    raw = {"name": "p", "windows": [{"size_ms": 1_000}], "limits": {"on_future": "clamp"}}
    spec = parse_pipeline(raw)
    assert parse_pipeline(canonical_mapping(spec)) == spec
    default = canonicalize({**raw, "limits": {}})
    assert canonicalize(raw).spec_hash != default.spec_hash


def test_the_canonical_form_keeps_the_state_cap() -> None:
    raw = {"name": "p", "windows": [{"size_ms": 1_000}], "limits": {"max_state_cells": 5_000}}
    spec = parse_pipeline(raw)
    assert canonical_mapping(spec)["limits"]["max_state_cells"] == 5_000
    assert parse_pipeline(canonical_mapping(spec)) == spec
    default = canonicalize({**raw, "limits": {}})
    assert (
        "max_state_cells" not in canonical_mapping(parse_pipeline({**raw, "limits": {}}))["limits"]
    )
    assert canonicalize(raw).spec_hash != default.spec_hash


def test_the_canonical_form_keeps_the_per_key_cadence_only_when_set() -> None:
    raw = {"name": "p", "windows": [{"size_ms": 1_000}], "key_results_every_ms": 10_000}
    spec = parse_pipeline(raw)
    assert canonical_mapping(spec)["key_results_every_ms"] == 10_000
    assert parse_pipeline(canonical_mapping(spec)) == spec
    plain = {k: v for k, v in raw.items() if k != "key_results_every_ms"}
    assert "key_results_every_ms" not in canonical_mapping(parse_pipeline(plain))
    assert canonicalize(raw).spec_hash != canonicalize(plain).spec_hash


def test_the_hash_leaves_the_name_out_and_sees_every_setting() -> None:
    one, two = canonicalize_toml(SPEC), canonicalize_toml(SAME_ELSEWHERE)
    changed = canonicalize_toml(CHANGED)
    assert isinstance(one, CanonicalSpec)
    assert isinstance(two, CanonicalSpec)
    assert isinstance(changed, CanonicalSpec)
    assert one.spec_hash == two.spec_hash
    assert one.mapping["name"] != two.mapping["name"]
    assert one.spec_hash != changed.spec_hash
    assert one.mapping["aggregates"] == ["count", "mean", "p95"]
    assert canonicalize(one.mapping).spec_hash == one.spec_hash


def _deploy(registry: Registry, text: str, op: str = "deploy", now_ms: int = 1) -> Result:
    result, document = registry.decide(Request(op, "r", spec_toml=text), now_ms)  # type: ignore[arg-type]
    if document is not None:
        registry.commit(document)
    return result


def test_deploy_update_delete_and_redeploy_give_increasing_versions() -> None:
    registry = Registry()
    first = _deploy(registry, SPEC)
    assert (first.ok, first.version, first.change, first.name) == (True, 1, "created", "temps")
    again = _deploy(registry, SPEC)
    assert (again.ok, again.version, again.change) == (True, 1, "unchanged")
    updated = _deploy(registry, CHANGED, "update", now_ms=5)
    assert (updated.ok, updated.version, updated.change) == (True, 2, "updated")
    assert updated.spec_hash != first.spec_hash
    doc = registry.get("temps")
    assert doc is not None
    assert doc.changed_at_ms == 5
    assert doc.spec is not None
    deleted, tombstone = registry.decide(Request("delete", "d", name="temps"), 9)
    assert (deleted.ok, deleted.version, deleted.change) == (True, 3, "deleted")
    assert tombstone is not None
    assert tombstone.state == "deleted"
    registry.commit(tombstone)
    assert registry.deployed() == []
    back = _deploy(registry, SPEC)
    assert (back.ok, back.version, back.change) == (True, 4, "created")


@pytest.mark.parametrize(
    ("text", "reason", "field"),
    [
        ("name = ", "invalid_toml", ""),
        ('name = "temps"', "invalid_spec", "windows"),
        ('name = "a b"\n[[windows]]\nsize_ms = 1', "invalid_spec", "name"),
        (
            'name = "t"\naggregates = ["median!"]\n[[windows]]\nsize_ms = 1',
            "unknown_aggregate",
            "aggregates",
        ),
        ('name = "t"\n[[windows]]\nsize_ms = 0', "invalid_spec", "windows[0].size_ms"),
        (
            'name = "t"\n[[windows]]\nkind = "hopping"\nsize_ms = 10',
            "invalid_spec",
            "windows[0].slide_ms",
        ),
        ('name = "t"\n[[windows]]\nsize_ms = 1\ncolour = 2', "invalid_spec", "windows[0].colour"),
        ('name = "t"\nfoo = 1\n[[windows]]\nsize_ms = 1', "invalid_spec", "foo"),
        (
            'name = "t"\n[[windows]]\nsize_ms = 1\n[limits]\nmax_rows = 0',
            "invalid_spec",
            "limits.max_rows",
        ),
        ('name = "t"\npartitions = 100\n[[windows]]\nsize_ms = 1', "invalid_spec", "partitions"),
        ('name = "t"\ninputs = ["a/#/b"]\n[[windows]]\nsize_ms = 1', "invalid_spec", "inputs"),
    ],
)
def test_an_invalid_spec_is_refused_with_its_field_and_changes_nothing(
    text: str, reason: str, field: str
) -> None:
    registry = Registry()
    _deploy(registry, SPEC)
    before = registry.deployed()
    for op in ("deploy", "update"):
        result, document = registry.decide(Request(op, "x", spec_toml=text), 2)  # type: ignore[arg-type]
        assert (result.ok, result.reason, result.field, document) == (False, reason, field, None)
        assert result.message
    assert registry.deployed() == before


def test_a_name_clash_unknown_names_and_unreadable_requests_are_refused() -> None:
    registry = Registry()
    _deploy(registry, SPEC)
    clash, doc = registry.decide(Request("deploy", "c", spec_toml=CHANGED), 2)
    assert (clash.ok, clash.reason, clash.field, clash.version, doc) == (
        False,
        "name_clash",
        "name",
        1,
        None,
    )
    unknown, doc = registry.decide(Request("delete", "u", name="nope"), 2)
    assert (unknown.ok, unknown.reason, unknown.field, doc) == (
        False,
        "unknown_pipeline",
        "name",
        None,
    )
    missing, doc = registry.decide(Request("update", "m", spec_toml=SAME_ELSEWHERE), 2)
    assert (missing.ok, missing.reason, doc) == (False, "unknown_pipeline", None)
    assert [d.version for d in registry.deployed()] == [1]
    for payload, reason, field in (
        (b"{not json", "invalid_json", None),
        (b"[1]", "invalid_request", None),
        (b'{"v": 2, "op": "deploy", "id": "x"}', "invalid_request", "v"),
        (b'{"v": 1, "op": "explode", "id": "x"}', "invalid_request", "op"),
        (b'{"v": 1, "op": "deploy", "id": "x"}', "invalid_request", "spec_toml"),
        (
            b'{"v": 1, "op": "delete", "id": "x", "name": "a", "spec_toml": "b"}',
            "invalid_request",
            "spec_toml",
        ),
        (b'{"v": 1, "op": "delete", "id": "", "name": "a"}', "invalid_request", "id"),
        (
            b'{"v": 1, "op": "delete", "id": "x", "name": "a", "extra": 1}',
            "invalid_request",
            "extra",
        ),
    ):
        with pytest.raises(ControlError) as refused:
            Request.from_json(payload)
        result = refuse_unreadable(refused.value)
        assert (result.ok, result.reason, result.field) == (False, reason, field), payload


def test_messages_round_trip() -> None:
    request = Request("deploy", "abc", spec_toml=SPEC)
    assert Request.from_json(request.to_json()) == request
    delete = Request("delete", "abc", name="temps")
    assert Request.from_json(delete.to_json()) == delete
    registry = Registry()
    result, document = registry.decide(request, 7)
    assert Result.from_json(result.to_json()) == result
    assert document is not None
    assert PipelineDocument.from_json(document.to_json()) == document


def test_restore_keeps_versions_and_refuses_a_tampered_document() -> None:
    source = Registry()
    _deploy(source, SPEC)
    _deploy(source, CHANGED, "update")
    stored = source.get("temps")
    assert stored is not None
    restored = Registry()
    restored.restore(stored)
    assert restored.deployed() == [stored]
    assert _deploy(restored, SPEC, "update").version == 3
    assert stored.spec is not None
    tampered = PipelineDocument(
        "temps", 7, "deployed", stored.spec_hash, {**stored.spec, "lateness_ms": 1}, 1
    )
    fresh = Registry()
    with pytest.raises(ControlError, match="does not match") as bad:
        fresh.restore(tampered)
    assert bad.value.reason == "invalid_document"
    assert fresh.deployed() == []
    assert _deploy(fresh, SPEC).version == 8  # versions never go back


def test_the_canonical_form_of_a_sliding_window_names_its_step() -> None:
    raw = {"name": "p", "windows": [{"kind": "sliding", "size_ms": 10_000}]}
    spec = parse_pipeline(raw)
    mapping = canonical_mapping(spec)
    assert mapping["windows"][0]["step_ms"] == 1_000
    assert "slide_ms" not in mapping["windows"][0]
    assert parse_pipeline(mapping) == spec


def _commit(registry: Registry, request: Request, now: int = 0) -> Result:
    """Decide, then commit as the service does (follow-ups included)."""
    result, document = registry.decide(request, now)
    if document is not None:
        previous = registry.get(document.name)
        registry.commit(document)
        for follow_up in registry.follow_ups(previous, now):
            registry.commit(follow_up)
    return result


def test_an_identical_spec_under_another_name_is_an_alias_counted_by_reference() -> None:
    registry = Registry()
    assert _commit(registry, Request("deploy", "1", spec_toml=SPEC)).alias_of is None
    shared = _commit(registry, Request("deploy", "2", spec_toml=SAME_ELSEWHERE))
    assert shared.ok
    assert shared.alias_of == "temps"
    alias = registry.get("temps-2")
    assert alias is not None
    assert alias.alias_of == "temps"
    assert not alias.computes
    assert registry.aliases_of("temps") == ["temps-2"]
    assert registry.aliases() == {"temps": ["temps-2"]}  # every computation's, in one pass
    assert PipelineDocument.from_json(alias.to_json()) == alias
    # A shared computation cannot change under its aliases.
    refused = _commit(registry, Request("update", "3", spec_toml=CHANGED))
    assert (refused.ok, refused.reason) == (False, "shared")
    # Deleting its name releases it: it goes on computing for the alias.
    assert _commit(registry, Request("delete", "4", name="temps")).ok
    released = registry.get("temps")
    assert released is not None
    assert released.computes
    assert released.released
    assert not released.named
    assert _commit(registry, Request("delete", "5", name="temps")).reason == "unknown_pipeline"
    # The last alias gone, the released computation is tombstoned too.
    assert _commit(registry, Request("delete", "6", name="temps-2")).ok
    gone = registry.get("temps")
    assert gone is not None
    assert not gone.deployed
    assert registry.deployed() == []


def test_deleting_an_alias_keeps_the_computation() -> None:
    registry = Registry()
    _commit(registry, Request("deploy", "1", spec_toml=SPEC))
    _commit(registry, Request("deploy", "2", spec_toml=SAME_ELSEWHERE))
    assert _commit(registry, Request("delete", "3", name="temps-2")).ok
    temps = registry.get("temps")
    assert temps is not None
    assert temps.named
    assert registry.aliases_of("temps") == []
    assert registry.aliases() == {}
    # Unshared now: it may be updated.
    assert _commit(registry, Request("update", "4", spec_toml=CHANGED)).change == "updated"
