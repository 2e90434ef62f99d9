"""Run the baseline service under Waitress in this process (``python -m ...server``).

Prints one JSON line, ``{"port": N}``, once listening (``--port 0`` picks a free port), then
serves until SIGTERM/SIGINT. ``--threads 1`` is the research's configuration.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import Final

import orjson

from shoal.loadtest.baseline._extra import require
from shoal.loadtest.baseline.app import create_app

RECV_BYTES: Final = 256 * 1024
"""Waitress reads request bodies 8 KiB at a time by default. With several gateways uploading
megabyte bodies at once, its I/O thread then wakes hundreds of times per batch and takes the
GIL from the one worker thread each time; reading 256 KiB at a time makes the baseline faster,
never slower."""


def main(argv: list[str] | None = None) -> int:
    """Serve until told to stop."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--recv-bytes",
        type=int,
        default=RECV_BYTES,
        help="bytes Waitress reads from a socket at a time (its default is 8192)",
    )
    args = parser.parse_args(argv)
    waitress = require("waitress")
    server = waitress.create_server(
        create_app(),
        host=args.host,
        port=args.port,
        threads=args.threads,
        # Batches of 64,000 rows are about 7 MB of JSON; Waitress's default cap is 1 GB.
        max_request_body_size=256 * 1024 * 1024,
        recv_bytes=args.recv_bytes,
        channel_timeout=600,
    )

    def stop(_signum: int, _frame: FrameType | None) -> None:
        server.close()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stdout.write(orjson.dumps({"port": server.effective_port}).decode() + "\n")
    sys.stdout.flush()
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
