"""deploy/grafana/shoal.json is a dashboard Grafana can import: layout, variables, queries.

Which metrics it may query is checked against running processes in
tests/integration/test_metrics_live.py; this file checks the dashboard itself, offline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "shoal.json"
GRID_COLUMNS = 24


def board() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> Iterator[dict[str, Any]]:
    for panel in board()["panels"]:
        yield panel
        yield from panel.get("panels", [])


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board()["templating"]["list"]}


def test_the_dashboard_has_an_identity_and_picks_its_data_source() -> None:
    b = board()
    assert b["uid"]
    assert b["title"]
    assert isinstance(b["schemaVersion"], int)
    source = variables()["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")


def test_panels_have_unique_ids_and_fit_the_grid() -> None:
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))


def test_every_query_uses_the_chosen_data_source_and_defined_variables() -> None:
    known = set(variables()) | {"__rate_interval", "__interval"}
    targets = [(p, t) for p in panels() for t in p.get("targets", [])]
    assert len(targets) >= 20
    for panel, target in targets:
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["datasource"] == target["datasource"]
        used = set(re.findall(r"\$(\w+)", target["expr"]))
        assert used <= known, f"{panel['title']}: unknown variables {used - known}"
        if "repeat" in panel:
            assert panel["repeat"] in variables()


@pytest.mark.parametrize("pair", ["()", "[]", "{}"])
def test_queries_are_balanced(pair: str) -> None:
    opening, closing = pair
    for panel in panels():
        for target in panel.get("targets", []):
            depth = 0
            for char in target["expr"]:
                depth += (char == opening) - (char == closing)
                assert depth >= 0, target["expr"]
            assert depth == 0, target["expr"]


def test_rates_are_taken_of_counters_and_quantiles_of_buckets() -> None:
    for panel in panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in re.findall(r"rate\((\w+)", expr):
                assert name.endswith(("_total", "_bucket", "_sum", "_count")), expr
            if "histogram_quantile" in expr:
                assert "_bucket" in expr, expr
                assert re.search(r"by \([^)]*\ble\b", expr), expr
