"""How much memory this process may use: the machine's, or its container's limit if lower.

A combiner sizes its default state cap from it (``PipelineSpec.state_cap``). The limit of a
container is its cgroup's: ``memory.max`` (cgroup v2: Docker, Kubernetes, systemd) or
``memory.limit_in_bytes`` (cgroup v1), "max" or a page-rounded near-2^63 value meaning none.
Reading is split from parsing so that the parsing is tested on the files' texts.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Final

import psutil

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
_NO_LIMIT_V1: Final = 1 << 60
"""cgroup v1 writes "no limit" as the largest page multiple below 2^63; anything this large
is no limit."""


def cgroup_limit(text: str) -> int | None:
    """The byte limit of a ``memory.max`` / ``memory.limit_in_bytes`` text; None: no limit."""
    value = text.strip()
    if not value or value == "max":
        return None
    try:
        limit = int(value)
    except ValueError:
        return None
    return None if limit <= 0 or limit >= _NO_LIMIT_V1 else limit


def limit_files(proc_self_cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The files that may hold this process's memory limit, from ``/proc/self/cgroup``.

    cgroup v2: the ``0::<path>`` line's ``memory.max``; v1: the memory controller's line
    (``N:memory:<path>``) under ``<root>/memory``, and that hierarchy's root file (inside a
    container the path is often the host's while the container's own group is mounted at
    the root).
    """
    files = []
    for line in proc_self_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.strip().lstrip("/")
        if number == "0" and not controllers:
            files.append(root / relative / "memory.max")
        elif "memory" in controllers.split(","):
            files.append(root / "memory" / relative / "memory.limit_in_bytes")
    files.append(root / "memory" / "memory.limit_in_bytes")
    return list(dict.fromkeys(files))


def physical_memory_bytes() -> int | None:
    """The machine's RAM (psutil); None where it is not known."""
    try:
        total = int(psutil.virtual_memory().total)
    except (OSError, RuntimeError):
        return None
    return total if total > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def container_limit_bytes(root: Path = CGROUP_ROOT, proc: Path = Path("/proc")) -> int | None:
    """The lowest memory limit of this process's cgroups; None: none, or not readable."""
    limits = [
        limit
        for text in map(_read, limit_files(_read(proc / "self" / "cgroup") or "", root))
        if text is not None and (limit := cgroup_limit(text)) is not None
    ]
    return min(limits) if limits else None


@functools.cache
def usable_memory_bytes() -> int | None:
    """What this process may use: the lower of the machine's RAM and its cgroup's limit.

    Read once per process (a pool combiner builds a configuration per hosted partition).
    """
    known = [m for m in (physical_memory_bytes(), container_limit_bytes()) if m is not None]
    return min(known) if known else None
