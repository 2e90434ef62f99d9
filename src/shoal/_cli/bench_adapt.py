"""``shoal bench adapt``: adapter throughput (one and two processes) and the decoders' fuzz."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson


def register_adapt(benches: Any) -> None:
    """Add ``bench adapt``."""
    adapt: argparse.ArgumentParser = benches.add_parser(
        "adapt",
        help="device messages/s through `shoal adapt` (1 and 2 processes), or --fuzz",
        description="Preload an embedded Mosquitto with device messages, then time a plain "
        "subscriber (the broker's own limit), one `shoal adapt` process and two sharing the "
        "load, until every measurement reached the adapters' ingest topic. With --fuzz N, "
        "feed N hostile payloads per format through the adapter's decoders instead and exit "
        "1 if any crashed or was refused without a specific reason.",
    )
    adapt.add_argument("--devices", choices=("json", "raw", "sparkplug"), default="json")
    adapt.add_argument("--count", type=int, default=1000, help="devices (default 1000)")
    adapt.add_argument("--steps", type=int, default=100, help="messages per device (default 100)")
    adapt.add_argument("--publishers", type=int, default=2, help="publisher processes (default 2)")
    adapt.add_argument(
        "--fuzz", type=int, metavar="N", help="fuzz the decoders with N payloads per format"
    )
    adapt.add_argument("--seed", type=int, default=0, help="--fuzz: random seed")
    adapt.add_argument("--json", type=Path, metavar="FILE", help="write the record here")
    adapt.set_defaults(run=run_adapt)


def run_adapt(args: argparse.Namespace) -> int:
    """Run the throughput benchmark or the fuzz; print a summary."""
    if args.fuzz is not None:
        from shoal.loadtest.fuzz_devices import FUZZ_KINDS, fuzz  # noqa: PLC0415

        reports = [fuzz(kind, args.fuzz, args.seed).to_dict() for kind in FUZZ_KINDS]
        for r in reports:
            print(
                f"{r['kind']:>9}: {r['payloads']} payloads, {r['accepted']} accepted, "
                f"{r['refused']} refused in {len(r['refused_by_reason'])} reasons, "
                f"{r['crashes']} crashes"
            )
        if args.json:
            args.json.write_bytes(orjson.dumps({"fuzz": reports}, option=orjson.OPT_INDENT_2))
        return 1 if any(r["crashes"] for r in reports) else 0
    from shoal.loadtest.bench_adapt import run  # noqa: PLC0415

    record = run(args.devices, devices=args.count, steps=args.steps, publishers=args.publishers)
    if args.json:
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    sys.stdout.write(orjson.dumps(record, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if record["lost_measurements"] == 0 else 1
