"""The ``shoal`` command: one sub-command per component or tool.

Sub-commands live in ``shoal._cli.<name>`` and import their (heavy) composition roots only
when run, so ``shoal --help`` stays fast and a worker never imports pandas.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

from shoal import __version__
from shoal._cli.common import setup_logging
from shoal.errors import ShoalError

COMMANDS: Final = ("broker",)
"""Sub-command modules, in the order ``--help`` lists them."""


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
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
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
