"""Fixtures for the wire-contract tests: where the committed contract files live."""

from __future__ import annotations

from pathlib import Path

import pytest

SCHEMAS_DIR = Path(__file__).resolve().parents[3] / "schemas"


@pytest.fixture(scope="session")
def schemas_dir() -> Path:
    """The repository's ``schemas/`` folder (the contract, JSON Schemas, golden payloads)."""
    return SCHEMAS_DIR
