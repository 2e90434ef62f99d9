"""The checkpoint folder's lock: one writer of a partition's checkpoint at a time.

A pool combiner takes a partition's MQTT session first (the broker deposes any previous
owner's connection, so it can publish and confirm nothing more), then this lock: an
exclusive ``flock`` on ``<state_dir>/owner.lock``. The deposed owner holds the lock until
its last checkpoint write has finished and its run has ended; the kernel releases it the
moment a process dies (kill -9 included). Only then does the new owner read the checkpoint,
so it always restores the newest one, and no deposed writer can overwrite a newer one.
``flock`` holds on a local disk and on NFSv4 (a Kubernetes RWX volume).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path
from typing import Final

from shoal.errors import BrokerError

LOCK_FILE: Final = "owner.lock"
POLL_S: Final = 0.05


class CheckpointLock:
    """An exclusive lock on one checkpoint folder, acquired without blocking the event loop."""

    def __init__(self, state_dir: Path) -> None:
        """Lock ``state_dir / LOCK_FILE`` (the folder is created)."""
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    async def acquire(self, timeout_s: float) -> None:
        """Wait until the lock is ours.

        Raises:
            BrokerError: another owner still held it after ``timeout_s`` (it may be stuck;
                the caller gives the partition up and tries again later).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if loop.time() >= deadline:
                    os.close(fd)
                    raise BrokerError(
                        f"checkpoint folder {self.path.parent} is still locked by a previous "
                        f"owner after {timeout_s:g} s"
                    ) from None
                await asyncio.sleep(POLL_S)
            else:
                self._fd = fd
                return

    def release(self) -> None:
        """Give the lock up (closing the descriptor releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
