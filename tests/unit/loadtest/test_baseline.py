"""The baseline service and its gateways' encoding, without sockets."""

from __future__ import annotations

import numpy as np
import orjson
import pandas as pd
import pytest

from shoal.errors import ConfigError
from shoal.loadtest.baseline._extra import require
from shoal.loadtest.baseline.app import PROCESSING_HEADER, ROUTE, analyse, create_app
from shoal.loadtest.baseline.driver import BatchRecord, DriverConfig, DriverReport, RowEncoder
from shoal.loadtest.data import SensorField


def _batch(rows: int = 3_000, *, attributes: bool = True) -> tuple[bytes, SensorField]:
    field = SensorField("sim-gw000", 500, 25.0, 1_700_000_000_000, seed=3)
    block = field.take(1_700_000_000_000 + 1_000).slice(0, rows)
    body = RowEncoder("sim-gw000", field.ids, attributes=attributes).encode(block, 7, 123)
    return body, field


def test_rows_carry_the_research_fields_and_the_envelope() -> None:
    body, field = _batch(10)
    batch = orjson.loads(body)
    assert (batch["gateway_id"], batch["seq"], batch["sent_at"]) == ("sim-gw000", 7, 123)
    row = batch["measurements"][0]
    assert set(row) == {"sensor_id", "name", "type", "unit", "value", "ts"}
    assert row["sensor_id"] in field.ids
    bare = orjson.loads(_batch(10, attributes=False)[0])["measurements"][0]
    assert set(bare) == {"sensor_id", "value", "ts"}


def test_statistics_per_sensor_match_a_plain_computation() -> None:
    body, _ = _batch()
    rows = orjson.loads(body)["measurements"]
    result = orjson.loads(analyse(body, pd))
    by_sensor: dict[str, list[float]] = {}
    for row in rows:
        by_sensor.setdefault(row["sensor_id"], []).append(row["value"])
    assert set(result) == set(by_sensor)
    for sensor, values in by_sensor.items():
        stats = result[sensor]
        assert stats["count"] == len(values)
        assert stats["mean"] == pytest.approx(np.mean(values))
        assert stats["min"] == pytest.approx(min(values), rel=1e-14)
        assert stats["max"] == pytest.approx(max(values), rel=1e-14)


def test_the_app_reports_its_processing_time_and_refuses_garbage() -> None:
    client = create_app().test_client()
    body, _ = _batch(100)
    response = client.post(ROUTE, data=body, content_type="application/json")
    assert response.status_code == 200
    assert float(response.headers[PROCESSING_HEADER]) > 0
    assert sum(s["count"] for s in response.get_json().values()) == 100
    assert client.post(ROUTE, data=b"{not json", content_type="application/json").status_code == 400
    assert client.post(ROUTE, data=b"{}", content_type="application/json").status_code == 400


def test_a_missing_extra_says_how_to_install_it() -> None:
    with pytest.raises(ConfigError, match=r"pip install 'shoal\[bench\]'"):
        require("shoal_no_such_module")


def test_driver_config_and_report_survive_json() -> None:
    config = DriverConfig(urls=("http://127.0.0.1:1",), gateways=10, rate_hz=4.0)
    assert DriverConfig.from_json(config.to_json()) == config
    assert config.offered_rate == 40_000
    record = BatchRecord(0, 1, 4000, 1.0, 1.1, 1.3, 25.0, 500_000, 4000, 200)
    assert record.t_rr_ms == pytest.approx(200.0)
    assert record.sealed_to_reply_ms == pytest.approx(300.0)
    report = DriverReport({}, 4000, 1.0, [record], 0, 0, 0, 0.5)
    assert DriverReport.from_json(report.to_json()) == report
