"""Rules in pipeline specs: parsed and refused by field, shipped examples run exactly in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from shoal.control.canonical import (
    SpecRefusal,
    canonical_mapping,
    canonicalize_toml,
    inline_files,
)
from shoal.errors import ConfigError
from shoal.processors.spec import load_pipeline, parse_pipeline
from tests.support.compare import assert_matches_oracle
from tests.support.datasets import make_batches, two_window_spec
from tests.support.in_memory import run_in_memory
from tests.support.rules_oracle import (
    RULES,
    expected_transitions,
    expected_with_rules,
    rows_of,
    with_attributes,
)

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "processors" / "examples").glob("*.toml"))
MINIMAL: dict[str, Any] = {"name": "p", "windows": [{"size_ms": 1_000}]}


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "filter-derive.toml",
        "alerting.toml",
        "udf.toml",
        "udaf-ewm.toml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_run_exactly_in_memory(path: Path) -> None:
    """Each example over a data set with attributes, 3 workers and 2 partitions, duplicated
    and shuffled deliveries: its results, counts and alert transitions are the oracle's."""
    spec = load_pipeline(path)
    spec = parse_pipeline(
        {
            **canonical_mapping(spec),
            "partitions": 2,
            "idle_timeout_ms": 1_500,
            "lateness_ms": 1_000,
            "windows": [{"name": spec.windows[0].name, "kind": "tumbling", "size_ms": 2_000}],
            "limits": {"max_future_ms": False},
        }
    )
    batches = with_attributes(make_batches(seed=5, batches_per_gateway=20), seed=5)
    emitted, late, combiners = run_in_memory(spec, batches, seed=5)
    want = expected_with_rules(rows_of(batches), spec)
    threshold = min(c.closed_through for c in combiners if c.closed_through is not None)
    closed = pl.col("end") <= threshold
    assert want.filtered > 0 or spec.where is None
    assert_matches_oracle(
        emitted.drop("revision", "partition", strict=False),
        want.published.filter(closed),
        spec,
        want.scale,
    )
    assert sum(x.rows for x in late) == want.late
    for combiner in combiners:
        assert combiner.counters.rows_filtered == want.filtered
    if spec.alerts:
        got = [(t.alert, t.key, t.start, t.state) for c in combiners for t in c.transitions]
        assert len(got) == len(set(got))
        assert set(got) == expected_transitions(want.results.filter(closed), spec)


@pytest.mark.parametrize(("workers", "partitions"), [(1, 1), (3, 2)])
def test_rules_and_alerts_equal_the_oracle_in_memory(workers: int, partitions: int) -> None:
    spec = two_window_spec("rules", ["count", "mean", "max"], partitions, **RULES)
    batches = with_attributes(make_batches(seed=workers, batches_per_gateway=30), seed=workers)
    emitted, late, combiners = run_in_memory(spec, batches, seed=workers, workers=workers)
    want = expected_with_rules(rows_of(batches), spec)
    threshold = min(c.closed_through for c in combiners if c.closed_through is not None)
    closed = want.results.filter(pl.col("end") <= threshold)
    published = want.published.filter(pl.col("end") <= threshold)
    assert 0 < published.height < closed.height
    emitted = emitted.drop("revision", "partition", strict=False)
    assert_matches_oracle(emitted, published, spec, want.scale)
    assert sum(x.rows for x in late) == want.late
    got = [(t.alert, t.key, t.start, t.state) for c in combiners for t in c.transitions]
    assert len(got) == len(set(got))
    expected = expected_transitions(closed, spec)
    assert set(got) == expected
    assert {state for *_, state in expected} == {"firing", "resolved"}
    withheld = closed.join(published, on=["window", "start", "key"], how="anti")
    assert sum(c.counters.results_withheld for c in combiners) == withheld.height
    assert sum(c.counters.rows_withheld for c in combiners) == withheld["rows"].sum()


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"where": "temp > 3"}, "where", "unknown_column"),
        ({"where": 3}, "where", None),
        ({"derive": {"f": "value * "}}, "derive.f", "bad_expression"),
        ({"derive": {"f": 2}}, "derive.f", None),
        ({"having": "p99 > 3"}, "having", "unknown_column"),
        ({"alerts": [{"name": "a"}]}, "alerts[0].condition", None),
        ({"alerts": [{"name": "a", "condition": "mean"}]}, "alerts[0].condition", "wrong_type"),
        (
            {"alerts": [{"name": "a", "condition": "mean > 1", "resolve": "x < 1"}]},
            "alerts[0].resolve",
            "unknown_column",
        ),
        ({"alerts": [{"name": "a", "condition": "mean > 1", "for": 0}]}, "alerts[0].for", None),
        (
            {"alerts": [{"name": "a", "condition": "mean > 1", "window": "w"}]},
            "alerts[0].window",
            None,
        ),
        ({"alerts": [{"name": "a", "condition": "mean > 1", "when": 1}]}, "alerts[0].when", None),
        (
            {
                "alerts": [
                    {"name": "a", "condition": "mean > 1"},
                    {"name": "a", "condition": "mean > 2"},
                ]
            },
            "alerts",
            None,
        ),
    ],
)
def test_refused_rules_name_their_field(
    changes: dict[str, Any], field: str, reason: str | None
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_pipeline({**MINIMAL, **changes})
    assert (caught.value.field, caught.value.reason) == (field, reason)


def test_rules_survive_the_control_planes_canonical_form() -> None:
    text = (EXAMPLES[0].parent / "alerting.toml").read_text()
    canonical = canonicalize_toml(text)
    assert not isinstance(canonical, type(None))
    spec = canonical.spec  # type: ignore[union-attr]
    again = parse_pipeline(canonical.mapping)  # type: ignore[union-attr]
    assert again == spec
    assert (again.where, again.having, len(again.alerts)) == (spec.where, spec.having, 2)


def test_a_refused_expression_is_invalid_expression_to_the_control_plane() -> None:
    refusal = canonicalize_toml('name = "p"\nwhere = "temp > 1"\n[[windows]]\nsize_ms = 1000\n')
    assert (refusal.reason, refusal.field) == ("invalid_expression", "where")  # type: ignore[union-attr]
    assert "'temp'" in refusal.message  # type: ignore[union-attr]


def test_a_spec_without_rules_keeps_its_canonical_form() -> None:
    mapping = canonical_mapping(parse_pipeline(MINIMAL))
    assert not {"where", "derive", "having", "alerts"} & set(mapping)


def test_a_restored_combiner_makes_the_same_transitions_once() -> None:
    """Checkpoint mid-stream, keep going; a combiner restored from the checkpoint and fed the
    same later batches makes exactly the same transitions, and none of the earlier ones."""
    from shoal.clock import FakeClock  # noqa: PLC0415
    from shoal.processors.combine import Combiner  # noqa: PLC0415
    from shoal.processors.partials import BatchInfo, PartialBuilder  # noqa: PLC0415
    from tests.support.in_memory import statuses_for  # noqa: PLC0415

    spec = two_window_spec("rules", ["count", "mean", "max"], **RULES)
    batches = with_attributes(make_batches(seed=3, gateways=1, batches_per_gateway=40), seed=3)
    builder = PartialBuilder(spec, "w")
    clock = FakeClock()
    first = Combiner(spec, 0, clock)
    for status in statuses_for(batches, clock.now_ms()):
        first.receive_status(status)

    def feed(core: Combiner, part: list) -> list[tuple]:
        for batch in part:
            info = BatchInfo(batch.gateway_id, batch.seq, "s", 0, None, None, 0, 0, "w")
            for partial in builder.build(batch.frame, info, clock.now_ms()):
                core.receive(partial)
                core.tick()
        return [(t.key, t.start, t.state) for t in core.take_transitions()]

    before = feed(first, batches[:20])
    saved = first.snapshot()
    after = feed(first, batches[20:])
    assert before
    assert after
    restored = Combiner(spec, 0, clock)
    restored.restore(saved)
    assert feed(restored, batches[20:]) == after


@pytest.mark.parametrize(
    "changes",
    [{}, {"key": "unit", "derive": {**RULES["derive"], "unit": "lower(unit)"}}],  # type: ignore[dict-item]
    ids=["coded-key", "derived-key"],
)
def test_binary_batches_give_the_partials_of_their_frame(changes: dict[str, Any]) -> None:
    """A binary batch's dictionary-coded key is filtered alike (the worker's fast path), or,
    when derive replaces the key, grouped from the frame: the partials are those of the frame."""
    from shoal.processors.partials import BatchInfo, PartialBuilder  # noqa: PLC0415
    from shoal.schemas import Encoding, Measurements, decode_batch, encode_batch  # noqa: PLC0415

    (batch,) = with_attributes(make_batches(seed=9, gateways=1, batches_per_gateway=1), seed=9)
    payload = encode_batch(
        Measurements.from_frame(batch.frame),
        gateway_id="gw0",
        seq=0,
        sent_at_ms=0,
        encoding=Encoding.BINARY_COLUMNAR,
    )
    spec = two_window_spec("rules", ["count", "mean", "max"], **{**RULES, **changes})
    builder = PartialBuilder(spec, "w")
    decoded = decode_batch(payload, limits=spec.limits, now_ms=0)
    assert spec.key in decoded.codes  # the key arrives coded
    info = BatchInfo("gw0", 0, "s", decoded.rows, None, None, 0, 0, "w")
    (fast,) = builder.build_batch(decoded, info, 0)
    (slow,) = builder.build(decoded.frame, info, 0)
    assert fast.batch == slow.batch
    assert fast.batch.filtered > 0
    assert fast.aggs is not None
    assert slow.aggs is not None
    order = ["window", "start", "key"]
    assert fast.aggs.sort(order).equals(slow.aggs.sort(order))
    if changes:
        assert set(fast.aggs["key"].to_list()) <= {"c", "f"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_a_deployed_examples_document_validates_and_round_trips(path: Path) -> None:
    """What the control plane retains for a spec with rules fits pipeline-document.schema.json,
    and a pool worker reading it back gets the same spec."""
    import json  # noqa: PLC0415

    from jsonschema import Draft202012Validator  # noqa: PLC0415

    from shoal.control.messages import PipelineDocument  # noqa: PLC0415

    canonical = canonicalize_toml(inline_files(path.read_text(), path.parent))
    assert not isinstance(canonical, SpecRefusal)
    document = PipelineDocument(
        canonical.spec.name, 1, "deployed", canonical.spec_hash, canonical.mapping, 0
    )
    schema_path = Path(__file__).resolve().parents[3] / "schemas" / "pipeline-document.schema.json"
    schema = json.loads(schema_path.read_text())
    Draft202012Validator(schema).validate(json.loads(document.to_json()))
    back = PipelineDocument.from_json(document.to_json())
    assert back.spec is not None
    assert parse_pipeline(back.spec) == canonical.spec
