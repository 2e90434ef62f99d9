"""The close logs' writer: one thread per process that appends, rewrites and flushes them.

A combiner partition must have a close's log entry written (and flushed to disk when the
close publishes anything) before it publishes what the close decided
(``shoal.processors.close_log``). Done on the event loop, every close waited for its own
``fsync``: a pool combiner hosting 1,000 partitions spent 11-22 % of its loop there, and
everything else (partials, ticks, announcements) waited behind the disk.

``LogWriter.submit`` hands a write to a thread and returns a future that completes once the
bytes are in the file and, for a ``sync`` write, on disk; the runtime holds back every
publish started after it until then (``shoal.broker.held.HeldSession``). The thread works
like a database's group commit: it takes every write queued while it was busy, writes them
in the order they were submitted, then flushes the files that need it at once (up to
``SYNC_THREADS`` ``fsync`` calls in flight, which the file system joins into shared journal
commits) and completes their futures together. A partition's writes complete in the order it
submitted them.

A write that fails (a full disk) fails its future, and every later append to the same file
fails too until the file is rewritten whole (``replace``) or deleted: the log's entries are
deltas, and one missing in the middle would corrupt those after it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shoal.processors.close_log import LogWrite

_Outcome = tuple[asyncio.Future[None], BaseException | None]

SYNC_THREADS: Final = 8
"""``fsync`` calls the writer keeps in flight at once (each file flushed once per round)."""


@dataclass(slots=True)
class _Job:
    path: Path
    write: LogWrite | None
    """None: delete the file."""
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[None]


class LogWriter:
    """Writes close logs off the event loop (see the module docstring).

    ``sync_threads``: ``fsync`` calls in flight at once. ``delay_s``: a pause before each
    round's flushes (tests: a slow disk).
    """

    def __init__(self, *, sync_threads: int = SYNC_THREADS, delay_s: float = 0.0) -> None:
        """A writer whose thread starts with the first write."""
        self._sync_threads = sync_threads
        self._delay_s = delay_s
        self._lock = threading.Condition()
        self._jobs: list[_Job] = []
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._failed: dict[Path, OSError] = {}
        self.rounds = 0
        """Rounds done (each flushes the files of the writes queued during the previous one)."""
        self.synced = 0
        """``fsync`` calls made for appends (a file counts once per round)."""

    @property
    def queued(self) -> int:
        """Writes waiting for the next round (the thread is busy with the current one)."""
        with self._lock:
            return len(self._jobs)

    def submit(self, path: Path, write: LogWrite) -> asyncio.Future[None]:
        """Write ``write`` to ``path``; the future completes once it is done (see above)."""
        return self._queue(path, write)

    def unlink(self, path: Path) -> asyncio.Future[None]:
        """Delete ``path`` after the writes submitted before."""
        return self._queue(path, None)

    def _queue(self, path: Path, write: LogWrite | None) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the close-log writer is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="shoal-close-log", daemon=True
                )
                self._thread.start()
            self._jobs.append(_Job(path, write, loop, done))
            self._lock.notify()
        return done

    def close(self) -> None:
        """Finish the writes queued, then end the thread (the shared writer never closes)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self._pool is not None:
            self._pool.shutdown()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._lock.wait()
                if not self._jobs:
                    return
                jobs, self._jobs = self._jobs, []
            self._round(jobs)

    def _round(self, jobs: list[_Job]) -> None:
        """Write ``jobs`` in order, flush what needs it, then complete their futures."""
        failures: dict[int, BaseException] = {}
        try:
            self._write_all(jobs, failures)
        except Exception as exc:  # noqa: BLE001 - the thread must outlive any one round
            failures = dict.fromkeys(range(len(jobs)), exc)
        self.rounds += 1
        _complete(jobs, failures)

    def _write_all(self, jobs: list[_Job], failures: dict[int, BaseException]) -> None:
        pending: dict[Path, tuple[int, list[int]]] = {}  # path -> (open fd, its jobs)
        to_sync: set[Path] = set()
        try:
            for index, job in enumerate(jobs):
                carried: list[int] = []
                try:
                    self._apply(job, index, pending, to_sync, carried)
                except OSError as exc:
                    self._failed[job.path] = exc
                    entry = pending.pop(job.path, None)
                    if entry is not None:
                        os.close(entry[0])
                        carried += entry[1]
                    for earlier in [*carried, index]:
                        failures[earlier] = exc
            if to_sync and self._delay_s:
                threading.Event().wait(self._delay_s)
            for path, error in self._sync([p for p in to_sync if p in pending], pending):
                self._failed[path] = error
                for index in pending[path][1]:
                    failures[index] = error
        finally:
            for fd, _ in pending.values():
                os.close(fd)

    def _apply(
        self,
        job: _Job,
        index: int,
        pending: dict[Path, tuple[int, list[int]]],
        to_sync: set[Path],
        carried: list[int],
    ) -> None:
        """Do one job; ``carried``: earlier appends of the round that a rewrite stands for."""
        path, write = job.path, job.write
        if write is None or write.replace:
            if path in pending:
                # Appended earlier in this round: the rewrite holds those entries too (the log
                # rewrites every entry after the last durable checkpoint), or the file goes.
                fd, indexes = pending.pop(path)
                os.close(fd)
                carried += indexes
                to_sync.discard(path)
            self._failed.pop(path, None)
            if write is None:
                path.unlink(missing_ok=True)
            else:
                write_atomically(path, write.data)
            return
        failed = self._failed.get(path)
        if failed is not None:
            raise OSError(f"close log {path}: an earlier write failed ({failed})")
        if path not in pending:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            pending[path] = (fd, [])
        fd, indexes = pending[path]
        view = memoryview(write.data)
        while view:
            view = view[os.write(fd, view) :]
        indexes.append(index)
        if write.sync:
            to_sync.add(path)

    def _sync(
        self, paths: list[Path], pending: dict[Path, tuple[int, list[int]]]
    ) -> list[tuple[Path, OSError]]:
        """``fsync`` each of ``paths`` (several at once); the ones that failed."""

        def one(path: Path) -> tuple[Path, OSError] | None:
            try:
                os.fsync(pending[path][0])
            except OSError as exc:
                return path, exc
            return None

        self.synced += len(paths)
        if len(paths) <= 1 or self._sync_threads <= 1:
            results = [one(p) for p in paths]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._sync_threads, "shoal-close-log-sync")
            results = list(self._pool.map(one, paths))
        return [r for r in results if r is not None]


def write_atomically(path: Path, data: bytes | Sequence[bytes | memoryview]) -> None:
    """Replace ``path`` with ``data``: a temporary file flushed to disk, renamed, folder flushed.

    The checkpoint and the close log are written so (a crash leaves the old file or the new).
    ``data`` may come in pieces, written one after the other (``Combiner.snapshot_parts``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")  # the checkpoint and the close log, side by side
    with tmp.open("wb") as fh:
        fh.writelines([data] if isinstance(data, bytes) else data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_now(path: Path, write: LogWrite) -> None:
    """``write`` done in line (a restore before the event loop runs)."""
    if write.replace:
        write_atomically(path, write.data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as fh:
        fh.write(write.data)
        if write.sync:
            fh.flush()
            os.fsync(fh.fileno())


def _complete(jobs: list[_Job], failures: dict[int, BaseException]) -> None:
    """Complete every job's future on its own event loop (one call per loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    for index, job in enumerate(jobs):
        by_loop.setdefault(job.loop, []).append((job.done, failures.get(index)))
    for loop, outcomes in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, outcomes)
        except RuntimeError:
            continue  # that loop is closed: nobody waits for these any more


def _settle(outcomes: list[_Outcome]) -> None:
    for done, failure in outcomes:
        if done.done():
            continue
        if failure is None:
            done.set_result(None)
        else:
            done.set_exception(failure)


_shared: LogWriter | None = None
_shared_lock = threading.Lock()


def shared_writer() -> LogWriter:
    """The process's writer, shared by every combiner partition it runs (a group commit)."""
    global _shared  # noqa: PLW0603 - one writer per process is the point
    with _shared_lock:
        if _shared is None:
            _shared = LogWriter()
        return _shared
