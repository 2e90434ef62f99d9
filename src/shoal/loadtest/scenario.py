"""Load-test scenarios: the research's scenarios A and B as TOML files in ``loadtest/scenarios``.

Pure parsing; imports nothing but the schemas and errors.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal._resources import resource_dir
from shoal.errors import ConfigError
from shoal.schemas import Encoding


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named load: how many gateways and sensors, the grid of rates and batch sizes.

    Attributes:
        name: short name (``A``, ``B``).
        description: one line for humans.
        gateways: gateways simulated.
        sensors_per_gateway: sensors behind each gateway.
        rates_hz: the measurement rates per sensor the scenario covers.
        batch_sizes: the batch sizes it covers.
        encodings: the encodings it covers.
        rate_hz: default rate.
        batch_size: default batch size.
        encoding: default encoding.
        duration_s: default duration.
    """

    name: str
    description: str
    gateways: int
    sensors_per_gateway: int
    rates_hz: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    encodings: tuple[Encoding, ...]
    rate_hz: float
    batch_size: int
    encoding: Encoding
    duration_s: float

    @property
    def sensors(self) -> int:
        """Sensors in all."""
        return self.gateways * self.sensors_per_gateway


def scenario_names() -> list[str]:
    """The shipped scenarios (``loadtest/scenarios/*.toml``)."""
    try:
        folder = resource_dir("loadtest") / "scenarios"
    except FileNotFoundError:
        return []
    return sorted(p.stem for p in folder.glob("*.toml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Load a shipped scenario by name (``"B"``) or a scenario file by path.

    Raises:
        ConfigError: no such scenario, or the file is not a valid scenario.
    """
    path = Path(name_or_path)
    if not path.suffix:
        try:
            path = resource_dir("loadtest") / "scenarios" / f"{name_or_path}.toml"
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from exc
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(scenario_names()) or "none"
        raise ConfigError(
            f"unknown scenario {str(name_or_path)!r}: no file {path} (shipped: {known})"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc}") from exc
    try:
        return _parse(data)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"scenario {path} is invalid: {exc!r}") from exc


def _parse(data: dict[str, Any]) -> Scenario:
    defaults = data.get("defaults", {})
    scenario = Scenario(
        name=str(data["name"]),
        description=str(data.get("description", "")),
        gateways=int(data["gateways"]),
        sensors_per_gateway=int(data["sensors_per_gateway"]),
        rates_hz=tuple(float(r) for r in data.get("rates_hz", [])),
        batch_sizes=tuple(int(b) for b in data.get("batch_sizes", [])),
        encodings=tuple(Encoding.parse(e) for e in data.get("encodings", [])),
        rate_hz=float(defaults.get("rate_hz", 25)),
        batch_size=int(defaults.get("batch_size", 16_000)),
        encoding=Encoding.parse(str(defaults.get("encoding", "binary-columnar"))),
        duration_s=float(defaults.get("duration_s", 60)),
    )
    if scenario.gateways <= 0 or scenario.sensors_per_gateway <= 0:
        raise ConfigError("gateways and sensors_per_gateway must be positive")
    return scenario
