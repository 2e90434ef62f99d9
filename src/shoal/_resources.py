"""Locate the repository's contract folders (``broker/``, ``processors/``, ``schemas/``, ...).

In a checkout (editable install) they sit at the repository root; a wheel carries copies
under ``shoal/_bundled/``. Library code asks here instead of guessing paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

_PACKAGE: Final = Path(__file__).resolve().parent
_CANDIDATES: Final = (_PACKAGE / "_bundled", _PACKAGE.parent.parent)


def resource_dir(name: str) -> Path:
    """The folder ``name`` (``"broker"``, ``"processors"``, ``"schemas"``, ``"loadtest"``).

    Raises:
        FileNotFoundError: neither a bundled copy nor a checkout holds it.
    """
    for root in _CANDIDATES:
        path = root / name
        if path.is_dir():
            return path
    raise FileNotFoundError(
        f"shoal resource folder {name!r} not found (looked in {', '.join(map(str, _CANDIDATES))}); "
        "reinstall shoal or run from a checkout"
    )
