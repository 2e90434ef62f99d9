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

Appends are written in place, not at the end of the file: a rewrite (``replace``) writes the
log followed by ``PREALLOCATE_BYTES`` of zeros, flushed to disk with it, and appends
overwrite those zeros (``pwrite`` at the log's end, which this module remembers per file, or
finds by reading the frames: ``close_log.frames_end``). Flushing such an append needs
``fdatasync`` only: the file's size and blocks do not change, so the file system has no
journal commit to make, only the data to write (on this project's virtual disk about half the
time of ``fsync`` after an ``O_APPEND`` write). An append that does not fit extends the file
by another ``PREALLOCATE_BYTES`` of zeros and is flushed with ``fsync``.

A write that fails (a full disk) fails its future, and every later append to the same file
fails too until the file is rewritten whole (``replace``) or deleted: the log's entries are
deltas, and one missing in the middle would corrupt those after it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shoal.processors.close_log import LogWrite, frames_end

_Outcome = tuple[asyncio.Future[None], BaseException | None]

SYNC_THREADS: Final = 8
"""``fsync`` calls the writer keeps in flight at once (each file flushed once per round)."""
PREALLOCATE_BYTES: Final = 64 * 1024
"""Zeros written after a log's bytes for appends to overwrite in place (rounded to 4 KiB)."""
_PAGE: Final = 4096


@dataclass(slots=True)
class _End:
    """Where a log file's next append goes, and its size (the preallocated zeros end there)."""

    inode: int
    end: int
    size: int


_ends: dict[Path, _End] = {}
_ends_lock = threading.Lock()


@dataclass(slots=True)
class _Open:
    """A file appended to in this round."""

    fd: int
    indexes: list[int]
    at: _End
    grew: bool = False
    """Extended this round: its new size must be flushed too (``fsync``, not ``fdatasync``)."""


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
        pending: dict[Path, _Open] = {}
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
                        os.close(entry.fd)
                        carried += entry.indexes
                        _forget(job.path)
                    for earlier in [*carried, index]:
                        failures[earlier] = exc
            if to_sync and self._delay_s:
                threading.Event().wait(self._delay_s)
            for path, error in self._sync([p for p in to_sync if p in pending], pending):
                self._failed[path] = error
                for index in pending[path].indexes:
                    failures[index] = error
        finally:
            for entry in pending.values():
                os.close(entry.fd)

    def _apply(
        self,
        job: _Job,
        index: int,
        pending: dict[Path, _Open],
        to_sync: set[Path],
        carried: list[int],
    ) -> None:
        """Do one job; ``carried``: earlier appends of the round that a rewrite stands for."""
        path, write = job.path, job.write
        if write is None or write.replace:
            if path in pending:
                # Appended earlier in this round: the rewrite holds those entries too (the log
                # rewrites every entry after the last durable checkpoint), or the file goes.
                entry = pending.pop(path)
                os.close(entry.fd)
                carried += entry.indexes
                to_sync.discard(path)
            self._failed.pop(path, None)
            if write is None:
                _forget(path)
                path.unlink(missing_ok=True)
            else:
                write_atomically(path, write.data, preallocate=True)
            return
        failed = self._failed.get(path)
        if failed is not None:
            raise OSError(f"close log {path}: an earlier write failed ({failed})")
        if path not in pending:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                pending[path] = _Open(fd, [], _end_of(path, fd))
            except OSError:
                os.close(fd)
                raise
        entry = pending[path]
        entry.grew = _write_at_end(entry.fd, entry.at, write.data) or entry.grew
        entry.indexes.append(index)
        if write.sync:
            to_sync.add(path)

    def _sync(self, paths: list[Path], pending: dict[Path, _Open]) -> list[tuple[Path, OSError]]:
        """Flush each of ``paths`` to disk (several at once); the ones that failed.

        ``fdatasync`` when the appends overwrote preallocated zeros, ``fsync`` when they
        extended the file.
        """

        def one(path: Path) -> tuple[Path, OSError] | None:
            entry = pending[path]
            try:
                (os.fsync if entry.grew else os.fdatasync)(entry.fd)
            except OSError as exc:
                _forget(path)
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


def write_atomically(path: Path, data: bytes, *, preallocate: bool = False) -> None:
    """Replace ``path`` with ``data``: a temporary file flushed to disk, renamed, folder flushed.

    The checkpoint and the close log are written so (a crash leaves the old file or the new).
    ``preallocate``: a close log, followed by zeros for its appends (see the module docstring).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")  # the checkpoint and the close log, side by side
    size = _rounded(len(data) + PREALLOCATE_BYTES) if preallocate else len(data)
    with tmp.open("wb") as fh:
        fh.write(data)
        if size > len(data):
            fh.write(bytes(size - len(data)))
        fh.flush()
        os.fsync(fh.fileno())
        inode = os.fstat(fh.fileno()).st_ino
    if preallocate:
        _forget(path)
    tmp.replace(path)
    if preallocate:
        with _ends_lock:
            _ends[path] = _End(inode, len(data), size)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_now(path: Path, write: LogWrite) -> None:
    """``write`` done in line (a restore before the event loop runs)."""
    if write.replace:
        write_atomically(path, write.data, preallocate=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        at = _end_of(path, fd)
        grew = _write_at_end(fd, at, write.data)
        if write.sync:
            (os.fsync if grew else os.fdatasync)(fd)
    except OSError:
        _forget(path)
        raise
    finally:
        os.close(fd)


def _rounded(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


def _forget(path: Path) -> None:
    """Where ``path`` ends is no longer known (a failed write, a rewrite): read it next time."""
    with _ends_lock:
        _ends.pop(path, None)


def _end_of(path: Path, fd: int) -> _End:
    """Where the next append to the open log ``path`` goes (remembered, or read from it)."""
    stat = os.fstat(fd)
    with _ends_lock:
        known = _ends.get(path)
        if known is not None and known.inode == stat.st_ino and known.size == stat.st_size:
            return known
    data = os.pread(fd, stat.st_size, 0) if stat.st_size else b""
    end = frames_end(data)
    if data and not end:
        raise OSError(f"close log {path} is not in the framed format: rewrite it")
    at = _End(stat.st_ino, end, stat.st_size)
    with _ends_lock:
        _ends[path] = at
    return at


def _write_at_end(fd: int, at: _End, data: bytes) -> bool:
    """Write ``data`` where the log ends (``at`` moves on); True if the file had to grow."""
    end = at.end + len(data)
    size = at.size
    if end > size:  # zeros after it again, so that the next appends are in place
        size = _rounded(end + PREALLOCATE_BYTES)
        data += bytes(size - end)
    view, offset = memoryview(data), at.end
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    grew = size > at.size
    at.end, at.size = end, size
    return grew


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
