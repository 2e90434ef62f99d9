"""A gateway in its own process, for kill -9 tests.

Adds chunks of rows whose values are globally unique (incarnation * 1e9 + running index),
flushes each chunk into its own batch and prints ``sealed <incarnation> <chunk>`` once the
flush returned (so the batch is in the spool). With a chunk limit it then closes, waiting
for every batch to be confirmed, and prints ``closed <ok> <next_seq>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from shoal.broker.settings import BrokerSettings
from shoal.gateway import Gateway, GatewayConfig
from shoal.schemas import Encoding, Topics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--spool", type=Path, required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=0, help="0: until killed")
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.005)
    args = parser.parse_args()
    config = GatewayConfig(
        args.gateway,
        stream=args.stream,
        broker=BrokerSettings(port=args.port),
        topics=Topics(args.root),
        encoding=Encoding.BINARY_COLUMNAR,
        spool_dir=args.spool,
        resend_after_ms=300,
        resend_window=64,
        status_interval_ms=200,
    )
    gateway = Gateway(config).start()
    sensors = np.array([f"s{i}" for i in range(10)])
    chunk = 0
    base = args.incarnation * 1_000_000_000
    while args.chunks == 0 or chunk < args.chunks:
        index = base + chunk * args.rows + np.arange(args.rows)
        now = int(time.time() * 1000)
        gateway.add_many(sensors[index % 10], np.full(args.rows, now), index.astype(np.float64))
        gateway.flush()
        print(f"sealed {args.incarnation} {chunk}", flush=True)
        chunk += 1
        time.sleep(args.interval)
    ok = gateway.close(timeout_s=30)
    print(f"closed {ok} {gateway.stats().next_seq}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
