"""``shoal adapt``: read what devices publish (JSON, raw values, Sparkplug B), act as a gateway."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from pathlib import Path
from typing import Any

from shoal._cli.common import (
    add_broker_options,
    add_metrics_options,
    add_stop_option,
    broker_settings,
    metrics_address,
    stop_timeout,
    topics,
)

log = logging.getLogger("shoal.adapt")


def register(sub: Any) -> None:
    """Add the ``adapt`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "adapt",
        help="device-native ingest: device topics → shoal batches (acts as a gateway)",
        description="Join a shared subscription on the mapping's device topics (persistent "
        "session, QoS 1), turn device messages into measurements and publish them as a shoal "
        "gateway (seq, spool, confirmations, re-sends). A device message is acknowledged only "
        "once its rows are on disk (the intake log beside the spool); refused ones go to "
        "shoal/deadletter/<mapping name> with the reason. Run several with different --id "
        "to share the load.",
    )
    parser.add_argument(
        "--mapping", required=True, type=Path, metavar="FILE", help="mapping file (TOML)"
    )
    parser.add_argument(
        "--id",
        default="adapter-1",
        help="stable adapter id: its gateway id and session; reuse it on restart "
        "(default adapter-1)",
    )
    parser.add_argument(
        "--spool-dir",
        type=Path,
        help="spool and intake log folder (default ./shoal-adapt-<id>); the state that makes a "
        "restart lose and repeat nothing",
    )
    parser.add_argument(
        "--stats-interval", type=float, default=10.0, help="log counters every N s (default 10)"
    )
    add_broker_options(parser)
    add_metrics_options(parser)
    add_stop_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one adapter until signalled."""
    from shoal._stopping import run_until_signalled  # noqa: PLC0415
    from shoal.adapters import Adapter, AdapterConfig, load_mapping  # noqa: PLC0415

    address = metrics_address(args)
    mapping = load_mapping(args.mapping)
    config = AdapterConfig(
        mapping,
        args.id,
        broker=broker_settings(args),
        topics=topics(args),
        spool_dir=args.spool_dir or Path(f"shoal-adapt-{args.id}"),
    )
    adapter = Adapter(config)
    # Everything imported and built so far lives as long as the process: out of the garbage
    # collector's full passes, which otherwise walk it again and again while device messages
    # come and go (docs/benchmarks.md, "Device adapters").
    gc.collect()
    gc.freeze()

    async def main() -> None:
        reporter = asyncio.create_task(_report(adapter, args.stats_interval))
        try:
            await adapter.run()
        finally:
            reporter.cancel()
            _log_stats(adapter)

    from shoal._cli._metrics import exposed  # noqa: PLC0415
    from shoal.observe.collectors import AdapterCollector  # noqa: PLC0415

    collector = lambda: AdapterCollector(adapter)  # noqa: E731
    run_until_signalled(
        exposed(main(), address, collector, "shoal adapt"),
        adapter.stop,
        "shoal adapt",
        grace_s=stop_timeout(args),
    )
    return 0


async def _report(adapter: Any, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        _log_stats(adapter)


def _log_stats(adapter: Any) -> None:
    s = adapter.stats
    log.info(
        "adapter %s: %d messages, %d rows sealed in %d seals, %d refused %s, %d redeliveries "
        "and %d duplicates dropped, %d commands sent, %d groups acknowledged",
        adapter.config.adapter_id,
        s.messages,
        s.rows,
        s.seals,
        sum(s.refused.values()),
        dict(s.refused),
        s.redeliveries,
        s.duplicates,
        s.commands,
        s.groups,
    )
