"""The shipped load-test scenarios parse and match the research's Table 1."""

from __future__ import annotations

import pytest

from shoal.errors import ConfigError
from shoal.loadtest.scenario import load_scenario, scenario_names
from shoal.schemas import Encoding


def test_scenarios_a_and_b_match_the_research() -> None:
    assert {"A", "B"} <= set(scenario_names())
    a, b = load_scenario("A"), load_scenario("B")
    assert (a.gateways, a.sensors) == (1, 1000)
    assert (b.gateways, b.sensors) == (10, 10_000)
    for scenario in (a, b):
        assert scenario.rates_hz == (4, 12, 25)
        assert scenario.batch_sizes == (4000, 16000, 32000, 64000)
        assert set(scenario.encodings) == set(Encoding)
        assert scenario.encoding is Encoding.BINARY_COLUMNAR
    assert b.sensors * b.rate_hz == 250_000


def test_a_scenario_file_by_path(tmp_path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text('name = "tiny"\ngateways = 2\nsensors_per_gateway = 3\n')
    tiny = load_scenario(path)
    assert (tiny.gateways, tiny.sensors, tiny.batch_size) == (2, 6, 16000)


def test_unknown_and_invalid_scenarios_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown scenario 'Z'"):
        load_scenario("Z")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n')
    with pytest.raises(ConfigError, match="invalid"):
        load_scenario(bad)
