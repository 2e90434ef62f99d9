"""Files for the reorder buffer's overflow (``processors.progress.Spill``): early arrivals on disk.

A combiner applies each gateway's batches in seq order, so partials that arrive ahead of a
slower one wait (``progress``). Under overload that wait is long: a batch sits seconds at a
busy worker while the later ones, dealt to the other workers, overtake it, and hundreds of
partials are early at once (315 batches, 79 MB, at 1.5x overload on 2 cores). Memory keeps
``max_pending_weight`` of them; the rest come here, encoded, one file each, and are read back
when their turn comes. Nothing here needs to survive the process: early arrivals are not
confirmed, so after a crash their gateways send them again. The folder is a temporary one
(``shoal-spill-<pid>-*``), removed when the spill is closed or collected or the interpreter
exits; folders a killed process left behind are removed by the next spill that starts there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Final, Generic, TypeVar

from shoal.processors.partials import Partial

T = TypeVar("T")

PREFIX: Final = "shoal-spill-"

MAX_SPILL_BYTES: Final = 1 << 30
"""Encoded bytes a spill holds at most (1 GiB); beyond, early arrivals are let go."""


class DirectorySpill(Generic[T]):
    """A ``progress.Spill`` in a temporary folder (created on first use under ``parent``).

    Args:
        encode: an item as bytes (``Partial.encode``).
        decode: the item back (``Partial.decode``).
        max_bytes: encoded bytes held at most (``room`` says no beyond).
        parent: where the temporary folder goes (None: the system's temporary folder).
    """

    def __init__(
        self,
        encode: Callable[[T], bytes],
        decode: Callable[[bytes], T],
        *,
        max_bytes: int = MAX_SPILL_BYTES,
        parent: Path | None = None,
    ) -> None:
        self._encode = encode
        self._decode = decode
        self.max_bytes = max_bytes
        self._parent = parent
        self._folder: Path | None = None
        self._remove: Callable[[], object] | None = None
        self._sizes: dict[tuple[str, int], int] = {}
        self.bytes = 0
        """Encoded bytes held now."""

    def room(self, weight: int) -> bool:
        """Whether there is room (judged by the in-memory ``weight``, an upper bound)."""
        return self.bytes + weight <= self.max_bytes

    def put(self, key: tuple[str, int], item: T) -> None:
        """Write ``item`` to its own file."""
        data = self._encode(item)
        self._path(key).write_bytes(data)
        self._sizes[key] = len(data)
        self.bytes += len(data)

    def take(self, key: tuple[str, int]) -> T:
        """Read the item back and remove its file."""
        path = self._path(key)
        item = self._decode(path.read_bytes())
        self.discard(key)
        return item

    def discard(self, key: tuple[str, int]) -> None:
        """Remove the item's file."""
        self.bytes -= self._sizes.pop(key, 0)
        self._path(key).unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove every item's file (the folder stays)."""
        for key in list(self._sizes):
            self.discard(key)

    def __len__(self) -> int:
        """Items kept now."""
        return len(self._sizes)

    def close(self) -> None:
        """Remove the folder and everything in it."""
        if self._remove is not None:
            self._remove()  # once: later calls do nothing
        self._folder = self._remove = None
        self._sizes.clear()
        self.bytes = 0

    def _path(self, key: tuple[str, int]) -> Path:
        if self._folder is None:
            _remove_orphans(self._parent)
            folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self._parent)
            # Removed at close, when the spill is collected, or when the interpreter exits.
            self._remove = weakref.finalize(self, _remove_folder, folder)
            self._folder = Path(folder)
        gateway_id, seq = key
        # Gateway ids are topic levels: any character but "/", "+", "#" and NUL; hex keeps
        # every one a valid file name.
        return self._folder / f"{gateway_id.encode().hex()}-{seq}"


def _remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _remove_orphans(parent: Path | None) -> None:
    """Remove spill folders of processes that no longer run (killed with a spill open)."""
    root = Path(parent if parent is not None else tempfile.gettempdir())
    for folder in root.glob(f"{PREFIX}*-*"):
        pid = folder.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            _remove_folder(str(folder))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def partial_spill() -> DirectorySpill[Partial]:
    """A combiner core's spill (``Combiner(spill=...)``): partials in their wire encoding."""
    return DirectorySpill(Partial.encode, Partial.decode)
