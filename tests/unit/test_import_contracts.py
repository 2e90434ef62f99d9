"""The import contracts in pyproject.toml hold, and they catch a forbidden import when one appears.

Each broken case copies the package to a temporary tree, adds one import (inside a function,
where a lazy import would hide it from a reader) and runs ``lint-imports`` on the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shoal

PACKAGE = Path(shoal.__file__).parent
ROOT = PACKAGE.parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path, src: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(ROOT, PACKAGE.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "added", "broken"),
    [
        (
            "processors/windows.py",
            "import shoal.loadtest",
            [
                "Only the CLI imports the load tester (shoal.loadtest)",
                "shoal.processors is not allowed to import shoal.loadtest",
            ],
        ),
        (
            "gateway/config.py",
            "import paho.mqtt.client",
            ["Only shoal.broker speaks MQTT (imports paho, aiomqtt or mqtt5)"],
        ),
        (
            "archive/read.py",
            "from shoal.client import ResultsClient",
            [
                "No import cycles between sibling packages or modules",
                "shoal.archive is not allowed to import shoal.client",
            ],
        ),
        (
            "runtime/worker.py",
            "import prometheus_client",
            ["Only shoal.observe imports prometheus_client"],
        ),
    ],
    ids=[
        "processors-imports-loadtest",
        "gateway-imports-paho",
        "archive-client-cycle",
        "runtime-imports-prometheus",
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, module: str, added: str, broken: list[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "shoal", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = src / "shoal" / module
    target.write_text(
        target.read_text() + f"\n\ndef _sneaky() -> None:\n    {added}  # noqa: PLC0415\n"
    )
    result = lint_imports(tmp_path, src)
    assert result.returncode == 1, result.stdout + result.stderr
    report = result.stdout.split("Broken contracts", 1)[-1]
    for text in broken:
        assert text in report, result.stdout
