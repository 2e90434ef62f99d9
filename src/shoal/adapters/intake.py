"""The adapter's intake log: decoded rows made durable before their device messages are acked.

The broker keeps at most the adapter's Receive Maximum of QoS 1 messages unacknowledged
(``max_messages``), so acknowledging only after a gateway batch is sealed would cap batches
at that many messages and stall the link while a batch fills. Instead the adapter appends
each group of decoded messages here (one write), acknowledges them, and seals batches of any
size later. Per group and per seal, in this order:

1. ``append(rows, entries)``: the rows, and which messages they came from (packet id, topic,
   CRC-32 of the payload), one JSON line;
2. the messages are acknowledged (PUBACK);
3. ``seal_begin(mark)``: a line with the gateway's next seq, then the gateway seals every
   logged row into its spool; ``sealed()`` after it returns, which may start a fresh file.

After a kill -9 (the page cache keeps what was written; ``fsync`` for power loss),
``recover(next_seq)`` returns the rows that were logged but not sealed: those after the last
seal line whose mark is below the recovered next seq (the seal reached the spool). They are
sealed again, once. A message logged but whose PUBACK had not left yet is delivered again by
the broker on the persistent session with the same packet id (MQTT 5 §4.4): ``arm`` /
``is_redelivery`` recognise the last groups' messages and drop them, each once, within
``horizon`` messages after a (re)connect (packet ids repeat only after 65,535 others).
``horizon`` is the adapter's Receive Maximum: the broker holds at most that many messages
unacknowledged, so the groups kept (the newest ones covering ``horizon`` messages) hold
every message the broker can send again, however many PUBACK writes were still queued.
A broker that does not hold to it (Mosquitto 2.0.11 after the first PUBACKs) sends more,
and one read, hence one group, may then hold more than ``horizon`` messages; the re-sends
are looked for within as many deliveries as the kept groups hold, whichever is more.

Pure file I/O; never imports the MQTT libraries.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from pathlib import Path
from typing import Any, Final, cast

import orjson

from shoal.adapters.decode import Row

log = logging.getLogger(__name__)

Entry = tuple[int, str, int]
"""A device message as the broker would redeliver it: packet id, topic, CRC-32 of payload."""

_KEEP_GROUPS: Final = 2
"""Groups kept at least, whatever their size (the last one's PUBACKs may still be on their
way when the next group is written)."""

COMPACT_BYTES: Final = 64 * 1024 * 1024
"""After a seal, a log larger than this starts afresh (everything in it is sealed)."""


class IntakeLog:
    """Rows logged but not yet sealed, on disk (``path``) or only in memory (``path`` None).

    Args:
        path: the log file (beside the gateway spool).
        horizon: messages after a (re)connect during which redeliveries are looked for.
        fsync: fsync every append (power-loss safe) instead of relying on the page cache.
    """

    def __init__(self, path: Path | None, *, horizon: int = 20_000, fsync: bool = False) -> None:
        self.path = path
        self.horizon = horizon
        self.fsync = fsync
        self._groups: deque[list[Entry]] = deque()
        self._kept = 0  # entries in ``_groups``
        self._armed: Counter[Entry] = Counter()
        self._seen_since_arm = 0
        self._window = horizon  # deliveries after a (re)connect looked at
        self._fd: int | None = None
        self._size = 0

    # -- start --------------------------------------------------------------------------------

    def recover(self, next_seq: int) -> list[Row]:
        """Open the log; the rows a previous run logged but did not seal (seal them again)."""
        if self.path is None:
            return []
        rows: list[Row] = []
        if self.path.exists():
            rows = self._replay(self.path.read_bytes(), next_seq)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        return rows

    def _replay(self, data: bytes, next_seq: int) -> list[Row]:
        rows: list[Row] = []
        for number, line in enumerate(data.split(b"\n")):
            if not line:
                continue
            try:
                record: dict[str, Any] = orjson.loads(line)
            except orjson.JSONDecodeError:
                # Only the last line can be torn (power loss without fsync): its messages were
                # never acknowledged, so the broker sends them again.
                log.warning("intake log %s: line %d unreadable, skipped", self.path, number + 1)
                continue
            if "seal" in record:
                if int(record["seal"]) < next_seq:
                    rows = []  # that seal reached the spool (else its rows are still to seal)
                continue
            rows.extend(cast("Row", tuple(r)) for r in record.get("rows", ()))
            self._remember([(int(m), str(t), int(c)) for m, t, c in record.get("entries", ())])
        return rows

    # -- running ------------------------------------------------------------------------------

    def append(self, rows: list[Row], entries: list[Entry]) -> None:
        """Make a group of messages' rows durable (before the messages are acknowledged)."""
        self._remember(entries)
        self._write({"rows": rows, "entries": entries})

    def _remember(self, entries: list[Entry]) -> None:
        """Keep ``entries`` as the newest group; forget groups the broker cannot re-send."""
        groups = self._groups
        groups.append(entries)
        self._kept += len(entries)
        while len(groups) > _KEEP_GROUPS and self._kept - len(groups[0]) >= self.horizon:
            self._kept -= len(groups.popleft())

    def seal_begin(self, mark: int) -> None:
        """Every logged row is about to be sealed; ``mark`` is the gateway's next seq now."""
        self._write({"seal": mark})

    def sealed(self) -> None:
        """The seal reached the spool; a large log starts afresh."""
        if self.path is None or self._size < COMPACT_BYTES:
            return
        tmp = self.path.with_suffix(".tmp")
        body = b"".join(orjson.dumps({"entries": g}) + b"\n" for g in self._groups)
        tmp.write_bytes(body)
        os.replace(tmp, self.path)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = len(body)

    def arm(self) -> None:
        """A (re)connect: the broker may now re-send the last groups' messages."""
        self._armed = Counter(e for group in self._groups for e in group)
        self._seen_since_arm = 0
        # The broker re-sends what it holds unacknowledged first: at most the kept groups.
        self._window = max(self.horizon, self._kept)

    @property
    def armed(self) -> bool:
        """Whether re-sends are being looked for (after a (re)connect, within the horizon)."""
        return bool(self._armed)

    def is_redelivery(self, entry: Entry) -> bool:
        """Whether ``entry`` is a message already logged (then it is forgotten: once only)."""
        if not self._armed:
            return False
        self._seen_since_arm += 1
        if self._seen_since_arm > self._window:
            self._armed.clear()
            return False
        if self._armed[entry] > 0:
            self._armed[entry] -= 1
            if not self._armed[entry]:
                del self._armed[entry]
            return True
        return False

    def close(self) -> None:
        """Close the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        line = orjson.dumps(record) + b"\n"
        os.write(self._fd, line)
        if self.fsync:
            os.fsync(self._fd)
        self._size += len(line)
