"""A worker process stays lean: what it imports is checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("pandas", "matplotlib", "flask", "pyarrow")


@pytest.mark.parametrize("heavy", HEAVY)
def test_the_worker_command_does_not_import(heavy: str) -> None:
    # What `shoal worker` loads before it handles a batch: the CLI, the worker runtime, the
    # decoder and the partial builder (pandas would cost ~40 MB of a worker's RSS budget).
    code = (
        "import sys\n"
        "import shoal.cli, shoal.runtime.worker, shoal.processors.partials, shoal.schemas\n"
        f"print({heavy!r} in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False", f"{heavy} is imported by the worker's modules"
