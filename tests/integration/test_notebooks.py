"""The notebooks in notebooks/ run top to bottom, unattended (each starts its own shoal)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
BUDGET_S = 120  # per cell; each notebook takes well under a minute


@pytest.fixture(autouse=True)
def _jupyter_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # Use the platform directories (and skip jupyter_core's deprecation warning about them).
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")


@pytest.mark.broker
@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_runs(name: str) -> None:
    import nbformat  # noqa: PLC0415 - dev dependencies, loaded only here
    from nbclient import NotebookClient  # noqa: PLC0415

    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=BUDGET_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    started = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - started
    print(f"{name}: {elapsed:.1f} s")
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
    figures = sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert figures > 0  # the plots were drawn
