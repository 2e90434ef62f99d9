"""The close log's synced appends at one window boundary: inline on the loop vs the writer.

Run from the repository root (docs/benchmarks.md, "Close-log
appends off the loop; one ticker per member")::

    python docs/bench/close_log_writer.py [PARTITIONS] [BOUNDARIES]

PARTITIONS logs (default 1,000) in a temporary folder each get one close entry that asks for
a flush to disk, all at once (pipelines with windows on the same grid close together), on an
event loop: inline as ``CombinerRuntime._write_log`` did (append, fsync) and through
``LogWriter`` (one thread, group commit), with 8 fsyncs in flight and with one. Prints, per
way, the median over BOUNDARIES rounds (default 5) of the time the loop was blocked and of
the time until every entry was durable.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shoal.processors.close_log import LogWrite
from shoal.runtime._log_writer import LogWriter

ENTRY = LogWrite(b"\x83\xa1k\xa5close\xa1v\x81\xa2gw\x05\xa9threshold\xcf" + bytes(8), False, True)


def _inline(path: Path) -> None:
    with path.open("ab") as fh:
        fh.write(ENTRY.data)
        fh.flush()
        os.fsync(fh.fileno())


async def _boundaries(paths: list[Path], rounds: int, writer: LogWriter | None) -> str:
    blocked, durable = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        futures = []
        for path in paths:
            if writer is None:
                _inline(path)
            else:
                futures.append(writer.submit(path, ENTRY))
        blocked.append(time.perf_counter() - started)
        await asyncio.gather(*futures)
        durable.append(time.perf_counter() - started)
        await asyncio.sleep(0.5)
    return (
        f"loop blocked {statistics.median(blocked) * 1000:.1f} ms, "
        f"all durable after {statistics.median(durable) * 1000:.1f} ms"
    )


def main() -> None:
    """Run the three ways and print one line each."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / f"p-{i}" / "combiner.closes" for i in range(count)]
        for path in paths:
            path.parent.mkdir()
            path.write_bytes(b"header")
        sys.stdout.write(
            f"inline, {count} partitions: {asyncio.run(_boundaries(paths, rounds, None))}" + "\n"
        )
        for threads in (8, 1):
            writer = LogWriter(sync_threads=threads)
            try:
                line = asyncio.run(_boundaries(paths, rounds, writer))
            finally:
                writer.close()
            sys.stdout.write(
                f"writer ({threads} fsyncs in flight), {count} partitions: {line}" + "\n"
            )


if __name__ == "__main__":
    main()
