"""`shoal bench sink` for real, shortened: two sink kills and a database restart mid-run, both
tables equal to the results a consumer saw, and a throughput figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.processes import assert_ran, run_shoal

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_bench_sink_is_exact_through_kills_and_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "sink.json"
    result = run_shoal(
        *("bench", "sink", "--duration", "20", "--rate", "10", "--json", str(out)),
        timeout=600,
    )
    assert_ran(result)
    assert "EXACT" in result.stdout
    record = json.loads(out.read_text())
    assert [f["fault"] for f in record["faults"]] == ["kill sink", "restart postgres", "kill sink"]
    for table in record["tables"].values():
        assert table["rows"] == record["result_rows"] > 0
        assert table["missing"] == table["extra"] == table["different"] == table["duplicates"] == 0
    assert record["sink_rows_per_s"] > 0
