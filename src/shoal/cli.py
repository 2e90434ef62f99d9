"""The ``shoal`` command: one sub-command per component or tool.

Sub-commands live in ``shoal._cli.<name>`` and import their (heavy) composition roots only
when run, so ``shoal --help`` stays fast and a worker never imports pandas.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Final

from shoal import __version__
from shoal.errors import ShoalError

COMMANDS: Final = (
    "up",
    "broker",
    "worker",
    "combiner",
    "scaler",
    "simulate",
    "adapt",
    "tail",
    "status",
    "view",
    "archive",
    "sink",
    "replay",
    "bench",
    "control",
    "pipeline",
)
"""Sub-command modules, in the order ``--help`` lists them."""

SINGLE_THREADED: Final = frozenset({"worker", "combiner"})
"""Processes meant to use one core each: several share a machine, and polars' default of
one thread per core would make them fight. Set POLARS_MAX_THREADS to override."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Stream processing for MQTT at the edge.",
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (repeatable)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"shoal._cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if any(a in SINGLE_THREADED for a in args_list[:3]):
        # Must happen before polars is imported (it sizes its thread pool at import).
        os.environ.setdefault("POLARS_MAX_THREADS", "1")
    from shoal._cli.common import setup_logging  # noqa: PLC0415 - after the thread setting

    parser = build_parser()
    args = parser.parse_args(args_list)
    setup_logging(args.verbose)
    if getattr(args, "embedded_broker", None):
        # Read by EmbeddedBroker here and in the processes this command starts.
        os.environ["SHOAL_EMBEDDED_BROKER"] = args.embedded_broker
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except ShoalError as exc:
        print(f"shoal {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
