"""The close logs' writer thread: order, group commit and failures, on real files."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shoal.processors.close_log import LogWrite
from shoal.runtime._log_writer import LogWriter


def append(data: bytes, *, sync: bool = True) -> LogWrite:
    return LogWrite(data, replace=False, sync=sync)


def test_writes_land_in_the_order_submitted(tmp_path: Path) -> None:
    writer = LogWriter()
    path = tmp_path / "p-0" / "combiner.closes"

    async def scenario() -> list[bytes]:
        seen = []
        first = writer.submit(path, append(b"a"))
        writer.submit(path, append(b"b", sync=False))
        await writer.submit(path, append(b"c"))
        assert first.done()
        seen.append(path.read_bytes())
        await writer.submit(path, LogWrite(b"HEAD", replace=True, sync=True))
        seen.append(path.read_bytes())
        writer.submit(path, append(b"d"))
        await writer.unlink(path)
        seen.append(b"gone" if not path.exists() else path.read_bytes())
        return seen

    try:
        assert asyncio.run(scenario()) == [b"abc", b"HEAD", b"gone"]
    finally:
        writer.close()


def test_writes_queued_during_a_round_share_the_next_one(tmp_path: Path) -> None:
    """A group commit: 40 partitions' closes queued behind a slow flush are written and flushed
    in one round, each file once however many entries it got."""
    writer = LogWriter(delay_s=0.3)
    paths = [tmp_path / f"p-{i}" / "combiner.closes" for i in range(40)]

    async def scenario() -> None:
        first = writer.submit(paths[0], append(b"x"))
        # Until the first round took it (and waits in its slow flush).
        await asyncio.wait_for(asyncio.to_thread(_until_taken, writer), 10)
        rest = [writer.submit(p, append(bytes([65 + k]))) for k in range(3) for p in paths]
        await asyncio.gather(first, *rest)

    try:
        asyncio.run(scenario())
    finally:
        writer.close()
    assert writer.rounds == 2
    assert writer.synced == 1 + len(paths)  # 120 synced appends, one fsync per file
    assert paths[0].read_bytes() == b"xABC"
    assert all(p.read_bytes() == b"ABC" for p in paths[1:])


def test_a_failed_write_fails_the_appends_after_it_until_the_file_is_rewritten(
    tmp_path: Path,
) -> None:
    writer = LogWriter()
    blocker = tmp_path / "p-0"
    blocker.write_text("a file where the partition's folder should be")
    path = blocker / "combiner.closes"

    async def scenario() -> None:
        with pytest.raises(OSError, match=r"p-0"):
            await writer.submit(path, append(b"a"))
        blocker.unlink()
        # The folder can be made now, but the entry before is missing: refused.
        with pytest.raises(OSError, match="an earlier write failed"):
            await writer.submit(path, append(b"b"))
        assert not path.exists()
        await writer.submit(path, LogWrite(b"HEAD", replace=True, sync=True))
        await writer.submit(path, append(b"c"))

    try:
        asyncio.run(scenario())
    finally:
        writer.close()
    assert path.read_bytes() == b"HEADc"


def test_futures_complete_on_the_loop_that_submitted_them(tmp_path: Path) -> None:
    """One process-wide writer serves every event loop (tests run one loop after another)."""
    writer = LogWriter()
    try:
        for k in range(3):
            asyncio.run(_write_one(writer, tmp_path / f"l{k}", k))
    finally:
        writer.close()
    assert [(tmp_path / f"l{k}").read_bytes() for k in range(3)] == [b"\x00", b"\x01", b"\x02"]


def _until_taken(writer: LogWriter) -> None:
    while writer.queued:
        time.sleep(0.01)


async def _write_one(writer: LogWriter, path: Path, k: int) -> None:
    await writer.submit(path, append(bytes([k])))
