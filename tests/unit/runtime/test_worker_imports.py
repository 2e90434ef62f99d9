"""Workers and combiners stay lean: what they import is checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("pandas", "matplotlib", "flask", "pyarrow")
ON_DEMAND = ("sqlglot", "websockets")
"""Loaded only when used: sqlglot by the first rule expression parsed (~16 MB alone), websockets
by a broker that serves WebSockets (~6 MB). Workers and combiners of a pipeline without rules
never need either (docs/benchmarks.md, "Memory at rest")."""


def _imports(modules: str, heavy: str) -> bool:
    code = f"import sys\nimport {modules}\nprint({heavy!r} in sys.modules)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout.strip() == "True"


@pytest.mark.parametrize("heavy", HEAVY + ON_DEMAND)
def test_the_worker_command_does_not_import(heavy: str) -> None:
    # What `shoal worker` loads before it handles a batch: the CLI, the worker runtime, the
    # decoder and the partial builder (pandas would cost ~40 MB of a worker's RSS budget).
    modules = "shoal.cli, shoal.runtime.worker, shoal.processors.partials, shoal.schemas"
    assert not _imports(modules, heavy), f"{heavy} is imported by the worker's modules"


@pytest.mark.parametrize("heavy", HEAVY + ON_DEMAND)
def test_the_combiner_command_does_not_import(heavy: str) -> None:
    modules = "shoal.cli, shoal._cli.combiner, shoal.runtime.combiner, shoal.processors.combine"
    assert not _imports(modules, heavy), f"{heavy} is imported by the combiner's modules"


def test_a_rule_expression_loads_sqlglot_when_parsed() -> None:
    # The lazy import is taken where it is needed (a UDF call found in an expression).
    code = (
        "import sys\n"
        "from shoal.rules.calls import across_rows\n"
        "assert 'sqlglot' not in sys.modules\n"
        "print(across_rows('value > avg(value)'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "AVG(value)"
