"""Lazy imports of the ``bench`` extra (Flask, Waitress) and of pandas, with one clear error."""

from __future__ import annotations

import importlib
from typing import Any

from shoal.errors import ConfigError


def require(module: str) -> Any:
    """Import ``module`` from the ``bench`` extra, or say how to install it.

    Raises:
        ConfigError: the module is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"the Flask/pandas baseline needs {module!r}: install the bench extra with "
            "pip install 'shoal[bench]' (or -e '.[bench]' in a checkout)"
        ) from exc
