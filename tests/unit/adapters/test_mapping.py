"""Mapping files: what they accept, and refusals that name the setting at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal._resources import resource_dir
from shoal.adapters import load_mapping, parse_mapping
from shoal.errors import ConfigError


def _route(**settings: Any) -> dict[str, Any]:
    return {"topic": "sensors/{site}/{device}", "format": "json-object", **settings}


def test_example_mappings_load() -> None:
    folder = resource_dir("mappings")
    names = sorted(p.name for p in folder.glob("*.toml"))
    assert names, "no example mappings"
    for path in folder.glob("*.toml"):
        load_mapping(path)


def test_topic_pattern_binds_named_levels_and_builds_the_filter() -> None:
    mapping = parse_mapping({"routes": [_route(topic="plant/{line}/+/{device}/#")]})
    route = mapping.routes[0]
    assert mapping.filters == ("plant/+/+/+/#",)
    assert route.topic.match("plant/l1/x/d9/a/b") == {"line": "l1", "device": "d9"}
    assert route.topic.match("plant/l1/x") is None
    assert route.topic.match("other/l1/x/d9") is None
    assert route.sensor_id.render({"line": "l1", "device": "d9"}) == "l1.d9"


def test_defaults() -> None:
    mapping = parse_mapping({"routes": [_route()]})
    route = mapping.routes[0]
    assert route.name is not None
    assert route.name.text == "{field}"
    assert route.timestamp.source == "arrival"
    assert mapping.group == "shoal-adapt-adapter"
    assert mapping.batching.max_rows == 10_000


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({}, "routes"),
        ({"routes": [_route(format="xml")]}, "routes[0].format"),
        ({"routes": [{"format": "raw"}]}, "routes[0].topic"),
        ({"routes": [_route(topic="a/{x}y/b")]}, "routes[0].topic"),
        ({"routes": [_route(topic="a/#/b")]}, "routes[0].topic"),
        ({"routes": [_route(topic="a/{x}/{x}")]}, "routes[0].topic"),
        ({"routes": [_route(sensor_id="{nope}")]}, "routes[0].sensor_id"),
        ({"routes": [_route(sensor_id="{site")]}, "routes[0].sensor_id"),
        ({"routes": [_route(timestamp={"unit": "days"})]}, "routes[0].timestamp.unit"),
        ({"routes": [_route(timestamp={"source": "payload"})]}, "routes[0].timestamp.field"),
        (
            {"routes": [{"topic": "h/{r}/{m}", "format": "raw", "timestamp": {"field": "ts"}}]},
            "routes[0].timestamp.source",
        ),
        ({"routes": [_route(colour="red")]}, "routes[0].colour"),
        ({"routes": [_route()], "batching": {"max_rows": 0}}, "batching.max_rows"),
        ({"routes": [_route()], "stream": "a/b"}, "stream"),
        ({"routes": [{"topic": "fixed/topic", "format": "raw"}]}, "routes[0].sensor_id"),
    ],
)
def test_refusals_name_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_mapping(raw)
    assert caught.value.field == field
    assert field in str(caught.value)


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text("routes = [", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_mapping(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_mapping(tmp_path / "missing.toml")


def test_shoal_adapt_names_the_bad_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoal.cli import main  # noqa: PLC0415 - the CLI entry point under test

    path = tmp_path / "m.toml"
    path.write_text('[[routes]]\ntopic = "a/{x}"\nformat = "yaml"\n', encoding="utf-8")
    assert main(["adapt", "--mapping", str(path)]) == 2
    assert "routes[0].format" in capsys.readouterr().err
