"""The gateway spool: every sealed batch, kept until the pipeline confirms it.

Design: one file per batch (``<seq>.batch``: a small JSON header with seq, content type,
rows, sealed-at time, payload size and CRC-32, then the payload), written under a temporary
name and renamed into place, so a record is either complete or absent: a kill -9 mid-write
leaves only a ``.tmp`` file, which the next start deletes. Beside the records, ``seq.mark``
holds the highest seq ever sealed (written after the record, by the same rename dance), so a
restarted gateway continues at ``max(mark, highest record) + 1`` and never reuses a seq,
even once every record has been confirmed and deleted.

With ``fsync=False`` the records survive a kill -9 (they are in the page cache); with
``fsync=True`` each record, the folder and the mark are fsynced, which survives power loss.
A record that still fails its checks on start (power loss without fsync, a damaged disk) is
moved to ``corrupt/`` and reported in ``Spool.damaged`` so the gateway can fill the hole.

One file per batch was chosen over an append-only log because deletion on confirmation is
then a plain ``unlink`` (no compaction), and at tens of batches per second the file count
is small. ``MemorySpool`` has the same interface without durability (simulations, tests).
Imports nothing from the broker.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import orjson

from shoal.errors import ConfigError, SpoolError

log = logging.getLogger(__name__)

MAGIC: Final = b"SHOALSP1"
_HEAD: Final = struct.Struct("<8sI")  # magic, header length
_SUFFIX: Final = ".batch"
_MARK: Final = "seq.mark"
_LOCK: Final = "LOCK"
_TMP: Final = ".tmp"


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    """What the spool knows about one batch without reading its payload.

    Attributes:
        seq: the batch's seq.
        content_type: the MQTT 5 content type to publish it with.
        rows: measurements in it (0 for the empty batches that keep seqs contiguous).
        payload_bytes: size of the payload.
        sealed_at_ms: gateway wall clock when it was sealed.
        resealed_from: for a batch cut from an older batch that no longer fit the broker's
            packet limit: that batch's seq, and which of its rows this one holds.
    """

    seq: int
    content_type: str
    rows: int
    payload_bytes: int
    sealed_at_ms: int
    resealed_from: tuple[int, int, int] | None = None

    def header(self, crc: int) -> bytes:
        """The record header as JSON."""
        fields: dict[str, Any] = {
            "seq": self.seq,
            "content_type": self.content_type,
            "rows": self.rows,
            "payload_bytes": self.payload_bytes,
            "sealed_at_ms": self.sealed_at_ms,
            "crc32": crc,
        }
        if self.resealed_from is not None:
            fields["resealed_from"] = list(self.resealed_from)
        return orjson.dumps(fields)

    @classmethod
    def from_header(cls, raw: bytes) -> tuple[SpoolEntry, int]:
        """Parse a record header; returns the entry and the payload's CRC-32."""
        obj = orjson.loads(raw)
        resealed = obj.get("resealed_from")
        entry = cls(
            seq=int(obj["seq"]),
            content_type=str(obj["content_type"]),
            rows=int(obj["rows"]),
            payload_bytes=int(obj["payload_bytes"]),
            sealed_at_ms=int(obj["sealed_at_ms"]),
            resealed_from=None if resealed is None else (*map(int, resealed),),  # type: ignore[arg-type]
        )
        return entry, int(obj["crc32"])


class Spool(ABC):
    """Sealed batches by seq, bounded in bytes, plus the seq high-water mark.

    Not thread-safe: the gateway serialises access. Records are kept in seq order; the
    gateway only ever adds seqs above every stored one and deletes from the bottom.

    Args:
        max_bytes: payload bytes the spool may hold (``put`` refuses more).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ConfigError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._entries: dict[int, SpoolEntry] = {}
        self._bytes = 0
        self._rows = 0
        self._high_water = -1
        self._mark_stored = -1
        self.damaged: list[int] = []
        """Seqs whose records could not be read back on open (moved aside)."""

    # -- reading -------------------------------------------------------------------------

    @property
    def high_water(self) -> int:
        """The highest seq ever stored (-1: none), even if since deleted."""
        top = max(self._entries, default=-1)
        return max(self._high_water, top, *self.damaged)

    @property
    def bytes_used(self) -> int:
        """Payload bytes held."""
        return self._bytes

    @property
    def rows_held(self) -> int:
        """Measurements in the records held."""
        return self._rows

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[SpoolEntry]:
        """Every record, in seq order."""
        return sorted(self._entries.values(), key=lambda e: e.seq)

    def get(self, seq: int) -> SpoolEntry | None:
        """The record of ``seq``, if held."""
        return self._entries.get(seq)

    def read(self, seq: int) -> bytes:
        """The payload of ``seq``.

        Raises:
            SpoolError: not held, or unreadable.
        """
        if seq not in self._entries:
            raise SpoolError(f"spool holds no batch with seq {seq}")
        return self._load(self._entries[seq])

    # -- writing -------------------------------------------------------------------------

    def free_bytes(self) -> int:
        """Payload bytes that still fit."""
        return max(0, self.max_bytes - self._bytes)

    def put(
        self, records: Sequence[tuple[SpoolEntry, bytes]], *, check_capacity: bool = True
    ) -> None:
        """Store new records (seqs above every held one), then raise the high-water mark.

        All or nothing for capacity: if they do not all fit, nothing is written.

        Raises:
            SpoolError: the spool is full (``check_capacity``), or a write failed (records
                before the failing one are stored).
        """
        if not records:
            return
        size = sum(len(payload) for _, payload in records)
        if check_capacity and self._bytes + size > self.max_bytes:
            raise SpoolError(
                f"the spool is full: it holds {self._bytes} of {self.max_bytes} bytes and "
                f"{len(records)} new batch(es) need {size} more. Rows were not accepted; "
                "wait for the pipeline to confirm (is it running?) or raise max_spool_bytes"
            )
        top = self.high_water
        for entry, payload in records:
            if entry.seq <= top:
                raise SpoolError(f"seq {entry.seq} is not above the spool's highest ({top})")
            if entry.payload_bytes != len(payload):
                raise SpoolError(
                    f"seq {entry.seq}: entry.payload_bytes ({entry.payload_bytes}) does not "
                    f"match the payload ({len(payload)} bytes)"
                )
            self._store(entry, payload)
            self._entries[entry.seq] = entry
            self._bytes += len(payload)
            self._rows += entry.rows
            top = entry.seq
        self._commit()
        self._high_water = top
        # The mark is persisted lazily, before the record holding the highest seq is deleted
        # (``delete_through``): until then that record itself carries the high-water mark.

    def replace(self, entry: SpoolEntry, payload: bytes) -> None:
        """Atomically replace (or fill in) the record of ``entry.seq`` below the mark."""
        if entry.seq > self.high_water:
            raise SpoolError(f"seq {entry.seq} is above the spool's mark; use put")
        old = self._entries.get(entry.seq)
        self._store(entry, payload)
        self._commit()
        self._bytes += len(payload) - (old.payload_bytes if old else 0)
        self._rows += entry.rows - (old.rows if old else 0)
        self._entries[entry.seq] = entry

    def delete_through(self, seq: int) -> list[SpoolEntry]:
        """Delete every record with a seq up to ``seq`` (confirmed); returns them."""
        gone = sorted((e for s, e in self._entries.items() if s <= seq), key=lambda e: e.seq)
        if gone and gone[-1].seq > self._mark_stored:
            # Records are about to stop carrying the high-water mark: persist it first.
            self._persist_mark(self.high_water)
        for entry in gone:
            self._remove(entry.seq)
            del self._entries[entry.seq]
            self._bytes -= entry.payload_bytes
            self._rows -= entry.rows
        return gone

    def raise_mark(self, seq: int) -> None:
        """Persist a high-water mark of at least ``seq`` (seqs up to it are never reused)."""
        if seq > self.high_water:
            self._high_water = seq
            self._persist_mark(seq)

    def _persist_mark(self, seq: int) -> None:
        self._store_mark(seq)
        self._mark_stored = max(self._mark_stored, seq)

    def close(self) -> None:  # noqa: B027 - a no-op by default; disk spools release a lock
        """Release resources (the spool's records stay)."""

    # -- storage ---------------------------------------------------------------------------

    @abstractmethod
    def _store(self, entry: SpoolEntry, payload: bytes) -> None: ...

    @abstractmethod
    def _load(self, entry: SpoolEntry) -> bytes: ...

    @abstractmethod
    def _remove(self, seq: int) -> None: ...

    @abstractmethod
    def _store_mark(self, seq: int) -> None: ...

    def _commit(self) -> None:  # noqa: B027 - only durable spools need a barrier
        """Make stored records durable before the mark moves past them."""


class MemorySpool(Spool):
    """A spool in memory: same interface, no durability (simulations and tests)."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        super().__init__(max_bytes)
        self._payloads: dict[int, bytes] = {}

    def _store(self, entry: SpoolEntry, payload: bytes) -> None:
        self._payloads[entry.seq] = payload

    def _load(self, entry: SpoolEntry) -> bytes:
        return self._payloads[entry.seq]

    def _remove(self, seq: int) -> None:
        self._payloads.pop(seq, None)

    def _store_mark(self, seq: int) -> None:
        pass


class DiskSpool(Spool):
    """The on-disk spool (see the module docstring for the format and guarantees).

    Opening takes an exclusive lock on the folder (two live gateways must never share a
    spool; the kernel releases the lock when a process dies, kill -9 included), deletes
    leftover temporary files and indexes the records.

    Args:
        directory: the spool folder (created if missing).
        max_bytes: payload bytes the spool may hold.
        fsync: fsync records, folder and mark (power-loss safe) instead of relying on the
            page cache (kill -9 safe).

    Raises:
        SpoolError: the folder cannot be created, locked or read.
    """

    def __init__(self, directory: Path, *, max_bytes: int = 1 << 30, fsync: bool = False) -> None:
        super().__init__(max_bytes)
        self.directory = Path(directory)
        self.fsync = fsync
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_file: IO[bytes] | None = (self.directory / _LOCK).open("ab")
        except OSError as exc:
            raise SpoolError(f"cannot open the spool folder {self.directory}: {exc}") from exc
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock_file.close()
            self._lock_file = None
            raise SpoolError(
                f"the spool {self.directory} is in use by another live gateway process; "
                "give each gateway its own spool_dir"
            ) from exc
        try:
            self._open()
        except OSError as exc:
            self.close()
            raise SpoolError(f"cannot read the spool {self.directory}: {exc}") from exc

    def _path(self, seq: int) -> Path:
        return self.directory / f"{seq:020d}{_SUFFIX}"

    def _open(self) -> None:
        for leftover in self.directory.glob(f"*{_TMP}"):
            leftover.unlink()  # a write that a crash interrupted; never renamed into place
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            try:
                seq = int(path.name.removesuffix(_SUFFIX))
            except ValueError:
                continue
            entry = self._check(path, seq)
            if entry is None:
                self._quarantine(path, seq)
                continue
            self._entries[seq] = entry
            self._bytes += entry.payload_bytes
            self._rows += entry.rows
        self._high_water = self._read_mark()
        self._mark_stored = self._high_water

    def _check(self, path: Path, seq: int) -> SpoolEntry | None:
        """The record's entry if it is complete and intact, else None."""
        problem = None
        try:
            entry, payload = self._parse(path.read_bytes())
        except (
            SpoolError,
            ValueError,
            KeyError,
            TypeError,
            struct.error,
            orjson.JSONDecodeError,
        ) as exc:
            problem = str(exc)
        else:
            if entry.seq == seq and len(payload) == entry.payload_bytes:
                return entry
            problem = "it does not match its name or size"
        log.error("spool record %s is damaged (%s); moving it to corrupt/", path, problem)
        return None

    @staticmethod
    def _parse(data: bytes) -> tuple[SpoolEntry, bytes]:
        magic, header_len = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise SpoolError("bad magic")
        start = _HEAD.size + header_len
        entry, crc = SpoolEntry.from_header(data[_HEAD.size : start])
        payload = data[start:]
        if len(payload) != entry.payload_bytes or zlib.crc32(payload) != crc:
            raise SpoolError("payload truncated or corrupt (CRC mismatch)")
        return entry, payload

    def _quarantine(self, path: Path, seq: int) -> None:
        corrupt = self.directory / "corrupt"
        corrupt.mkdir(exist_ok=True)
        path.replace(corrupt / path.name)
        self.damaged.append(seq)

    def _read_mark(self) -> int:
        path = self.directory / _MARK
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return -1
        if text.lstrip("-").isdigit():
            return int(text)
        # Only power loss without fsync leaves a torn mark (it is renamed into place).
        log.error("spool mark %s is damaged; continuing from the highest record", path)
        return -1

    def _write(self, path: Path, chunks: Sequence[bytes]) -> None:
        tmp = path.with_name(path.name + _TMP)
        with tmp.open("wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        tmp.replace(path)

    def _store(self, entry: SpoolEntry, payload: bytes) -> None:
        header = entry.header(zlib.crc32(payload))
        try:
            self._write(self._path(entry.seq), [_HEAD.pack(MAGIC, len(header)), header, payload])
        except OSError as exc:
            raise SpoolError(
                f"cannot write batch seq {entry.seq} to the spool {self.directory}: {exc}"
            ) from exc

    def _load(self, entry: SpoolEntry) -> bytes:
        try:
            _, payload = self._parse(self._path(entry.seq).read_bytes())
        except (OSError, ValueError, KeyError, struct.error, orjson.JSONDecodeError) as exc:
            raise SpoolError(
                f"cannot read batch seq {entry.seq} from the spool {self.directory}: {exc}"
            ) from exc
        return payload

    def _remove(self, seq: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(seq).unlink()

    def _commit(self) -> None:
        if self.fsync:
            self._sync_dir()

    def _store_mark(self, seq: int) -> None:
        try:
            self._write(self.directory / _MARK, [f"{seq}\n".encode()])
            if self.fsync:
                self._sync_dir()
        except OSError as exc:
            raise SpoolError(f"cannot write the seq mark in {self.directory}: {exc}") from exc

    def _sync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Release the folder lock."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
