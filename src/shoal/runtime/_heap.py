"""Giving freed heap memory back to the operating system (glibc's ``malloc_trim``).

A combiner's allocations come and go in large pieces (partials of ~200 kB, merge arrays,
result frames). glibc keeps what is freed in its heap for reuse, and its mmap threshold
rises after the first large frees, so later large blocks come from the heap too: after a
backlog the resident size stays at its high-water mark although little is live (a chaos
run: 85 MB of ``[heap]`` with ~45 MB live). ``malloc_trim(0)`` returns the free pages.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Final


def _load_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return trim


_TRIM: Final = _load_trim()


def release_free_memory() -> bool:
    """Return freed heap pages to the operating system; False where that is not possible."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
