"""``shoal simulate``: run simulated gateways (scenario A or B of the research, or custom)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from shoal._cli.common import add_broker_options, broker_settings, topics
from shoal.clock import ClockJump, SkewedClock, SystemClock
from shoal.errors import ConfigError

_DEFAULTS = {"gateways": 1, "sensors": 1000, "rate": 25.0, "batch": 16_000, "duration": 60.0}


def register(sub: Any) -> None:
    """Add the ``simulate`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "simulate",
        help="simulated gateways: open-loop synthetic sensors → batches → broker",
        description="Run simulated gateways that publish synthetic sensor batches in an open "
        "loop, and report offered vs achieved rate, bytes, re-sends, spool depth and CPU. "
        "Flags override the scenario's defaults.",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--scenario", metavar="NAME|FILE", help="A, B (loadtest/scenarios) or a scenario file"
    )
    load.add_argument(
        "--devices",
        choices=("json", "raw", "sparkplug"),
        help="publish like real devices instead of shoal gateways (for `shoal adapt`): one "
        "JSON object, raw value or Sparkplug B message per device and step; with --count, "
        "--rate (messages/s per device) and --duration",
    )
    load.add_argument("--count", type=int, default=100, help="--devices: devices (default 100)")
    load.add_argument(
        "--topic-prefix",
        help="--devices: first topic level(s) (default sensors, home or spBv1.0)",
    )
    load.add_argument("--gateways", type=int, help="number of gateways (default 1)")
    load.add_argument("--sensors", type=int, help="sensors per gateway (default 1000)")
    load.add_argument("--rate", type=float, help="measurements/s per sensor (default 25)")
    load.add_argument("--batch", type=int, help="rows per batch (default 16000)")
    load.add_argument("--encoding", help="json, msgpack, columnar or binary (default binary)")
    load.add_argument("--zstd", action="store_true", help="zstd-compress binary batches")
    load.add_argument("--duration", type=float, help="seconds to generate (default 60)")
    load.add_argument("--seed", type=int, default=0, help="random seed of the sensors")
    load.add_argument(
        "--attributes",
        action="store_true",
        help="measurements also carry name, type and unit (8 kinds of sensor)",
    )
    load.add_argument("--stream", default="sim", help="stream name (default sim)")
    load.add_argument("--gateway-prefix", default="sim-gw", help="gateway ids' prefix")
    load.add_argument("--tick-ms", type=int, default=50, help="scheduler period (default 50)")
    load.add_argument(
        "--max-delay-ms",
        type=int,
        default=1_000,
        help="seal a partial batch once its oldest row is this old (default 1000)",
    )
    load.add_argument(
        "--stagger",
        action="store_true",
        help="seal the gateways out of step: gateway i of N seals its first batch early, i/N "
        "of a batch's span (the time it takes to fill, or --max-delay-ms) after the start, so "
        "batches arrive spread over each span instead of all at once (benchmarks)",
    )
    gateway = parser.add_argument_group("gateway")
    gateway.add_argument(
        "--spool",
        choices=("disk", "memory", "off"),
        default="disk",
        help="disk (default), memory, or off (drop once the broker accepted: broker-only)",
    )
    gateway.add_argument("--spool-dir", type=Path, help="disk spool folder (default: temporary)")
    gateway.add_argument(
        "--wait-confirmed",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before exiting, wait up to this long for a pipeline to confirm every batch",
    )
    gateway.add_argument(
        "--clock-offset-ms",
        type=int,
        default=0,
        metavar="MS",
        help="the gateways' clocks run this far ahead (negative: behind) of this machine's; "
        "event times and sealing stamps follow them (default 0)",
    )
    gateway.add_argument(
        "--clock-drift-ppm",
        type=float,
        default=0.0,
        metavar="PPM",
        help="and drift by this many millionths of the elapsed time (default 0)",
    )
    gateway.add_argument(
        "--clock-jump-ms",
        type=int,
        default=0,
        metavar="MS",
        help="the gateways' clocks jump by this much (negative: back) at --clock-jump-at-s; "
        "sensors keep measuring at their rate, only their timestamps step (default 0)",
    )
    gateway.add_argument(
        "--clock-jump-at-s",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds after the start at which the clocks jump (default 0: from the start)",
    )
    gateway.add_argument(
        "--late-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="this share of measurements (0..1) get timestamps --late-by-ms older than their "
        "time, so that they are late by the per-gateway rule; the same --seed picks the "
        "same ones (default 0)",
    )
    gateway.add_argument(
        "--late-by-ms",
        type=int,
        default=60_000,
        metavar="MS",
        help="how far back late measurements are stamped; to be late it must exceed the "
        "pipeline's lateness_ms plus a window and --max-delay-ms (default 60000)",
    )
    gateway.add_argument(
        "--max-unconfirmed-mb",
        type=float,
        metavar="MIB",
        help="per gateway, payload published but not yet confirmed by the pipeline, at most: "
        "the end-to-end flow-control window (default 16); a backlog beyond it waits in the "
        "spool",
    )
    gateway.add_argument(
        "--resend-after-ms",
        type=int,
        metavar="MS",
        help="re-send the oldest unconfirmed batches when confirmations stall this long "
        "(default 5000); batches a combiner reports missing go at once anyway",
    )
    gateway.add_argument(
        "--sink",
        choices=("none", "count", "confirm"),
        help="a subscriber in a child process that counts what arrives, and with confirm also "
        "confirms it (default: count with --embedded, else none)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="FILE", help="write the report as JSON")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    add_broker_options(parser)
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="start an embedded Mosquitto (dev profile) instead of using --broker",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the simulation; exit 0 if everything sealed was delivered, 1 otherwise.

    Delivered: the broker accepted every sealed row and, where the run waits for
    confirmations, the pipeline confirmed every batch (a run stopped early also exits 0).
    """
    # Heavy imports here, not at registration: `shoal --help` stays fast.
    from shoal.broker.embedded import EmbeddedBroker  # noqa: PLC0415
    from shoal.loadtest.simulate import Simulator  # noqa: PLC0415

    if args.embedded and args.broker:
        raise ConfigError("--embedded starts its own broker; drop --broker (or --embedded)")
    if args.devices:
        return _run_devices(args)
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        observe: dict[str, int] = {}
        settings = broker_settings(args)
        if args.embedded:
            broker = stack.enter_context(EmbeddedBroker("dev"))
            settings = broker.settings
            if broker.pid is not None:
                observe["broker"] = broker.pid
        config = _config(args, settings)
        if not args.quiet:
            _print_header(config, embedded=args.embedded)
        stack.enter_context(_stop_on_signals(stop))
        clock = SkewedClock(SystemClock(), args.clock_offset_ms, args.clock_drift_ppm, _jumps(args))
        report = Simulator(config, clock, observe=observe).run(
            stop, progress=None if args.quiet else _print_progress
        )
    if args.json:
        args.json.write_bytes(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2))
    _print_summary(report)
    return exit_code(report)


def exit_code(report: Any) -> int:
    """0 if the run delivered everything it sealed (or was stopped early), else 1.

    The achieved rate is reported, not judged: re-sends after a broker restart push it above
    the offered rate for a while, and that loses nothing.
    """
    return 0 if report.delivered or report.stopped_early else 1


def _run_devices(args: argparse.Namespace) -> int:
    """``--devices``: publish device messages; exit 0 when every one was acknowledged."""
    from shoal.loadtest.devices import DeviceFleet, DevicePublisher  # noqa: PLC0415

    rate = 1.0 if args.rate is None else args.rate
    duration = _DEFAULTS["duration"] if args.duration is None else args.duration
    if rate <= 0 or duration <= 0:
        raise ConfigError("--rate and --duration must be positive")
    fleet = DeviceFleet(
        args.devices,
        args.count,
        prefix=args.topic_prefix or "",
        start_ms=int(time.time() * 1000),  # a CLI, not processing code: the wall clock
        step_ms=max(1, round(1000 / rate)),
    )
    steps = max(1, round(duration * rate))
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        settings = broker_settings(args)
        if args.embedded:
            from shoal.broker.embedded import EmbeddedBroker  # noqa: PLC0415

            settings = stack.enter_context(EmbeddedBroker("dev")).settings
        stack.enter_context(_stop_on_signals(stop))
        if not args.quiet:
            print(
                f"{args.count} {args.devices} devices under {fleet.root}/, {rate:g} messages/s "
                f"each for {steps / rate:g} s ({args.count * steps} messages) to {settings.url}"
            )
        publisher = DevicePublisher(settings, rate=rate * args.count)
        report = publisher.run(
            fleet.messages(0, steps),
            stop=stop,
            progress=None
            if args.quiet
            else lambda r: print(f"  sent {r.sent}, acknowledged {r.acknowledged}", flush=True),
        )
    summary = {
        "devices": args.devices,
        "count": args.count,
        "sent": report.sent,
        "acknowledged": report.acknowledged,
        "seconds": round(report.seconds, 3),
        "messages_per_s": round(report.rate, 1),
        "failed": report.failed[:10],
    }
    if args.json:
        args.json.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(
        f"sent {report.sent} device messages in {report.seconds:.1f} s "
        f"({report.rate:,.0f}/s), {report.acknowledged} acknowledged"
    )
    return 0 if report.acknowledged == report.sent and not report.failed else 1


def _jumps(args: argparse.Namespace) -> tuple[ClockJump, ...]:
    """The clock jump the flags ask for, if any."""
    if args.clock_jump_at_s < 0:
        raise ConfigError(f"--clock-jump-at-s must be >= 0, not {args.clock_jump_at_s}")
    if args.clock_jump_ms == 0:
        return ()
    return (ClockJump(round(args.clock_jump_at_s * 1000), args.clock_jump_ms),)


def _config(args: argparse.Namespace, settings: Any) -> Any:
    from shoal.loadtest.scenario import load_scenario  # noqa: PLC0415
    from shoal.loadtest.simulate import SimulationConfig  # noqa: PLC0415
    from shoal.schemas import Encoding  # noqa: PLC0415

    values: dict[str, Any] = dict(_DEFAULTS)
    encoding = Encoding.BINARY_COLUMNAR
    if args.scenario:
        scenario = load_scenario(args.scenario)
        values = {
            "gateways": scenario.gateways,
            "sensors": scenario.sensors_per_gateway,
            "rate": scenario.rate_hz,
            "batch": scenario.batch_size,
            "duration": scenario.duration_s,
        }
        encoding = scenario.encoding
    for name in values:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.encoding:
        encoding = Encoding.parse(args.encoding)
    sink: Any = args.sink or ("count" if args.embedded else "none")
    return SimulationConfig(
        gateways=values["gateways"],
        sensors=values["sensors"],
        rate_hz=values["rate"],
        batch_size=values["batch"],
        encoding=encoding,
        zstd=args.zstd,
        duration_s=values["duration"],
        spool=args.spool,
        spool_dir=args.spool_dir,
        sink=sink,
        seed=args.seed,
        attributes=args.attributes,
        stream=args.stream,
        gateway_prefix=args.gateway_prefix,
        topics=topics(args),
        broker=settings,
        tick_ms=args.tick_ms,
        max_delay_ms=args.max_delay_ms,
        max_unconfirmed_bytes=(
            None if args.max_unconfirmed_mb is None else int(args.max_unconfirmed_mb * 2**20)
        ),
        resend_after_ms=args.resend_after_ms,
        confirm_wait_s=args.wait_confirmed,
        late_share=args.late_share,
        late_by_ms=args.late_by_ms,
        stagger=args.stagger,
    )


def _stop_on_signals(stop: threading.Event) -> contextlib.AbstractContextManager[object]:
    """Ctrl-C (or SIGTERM) ends the run cleanly with a summary; a second one exits at once.

    The clean end is bounded by the run's own waits (``--wait-confirmed``, the drain
    timeout), cut short when no gateway is connected (``Simulator``).
    """
    from shoal._stopping import stop_signals  # noqa: PLC0415

    def first() -> None:
        print("\nstopping: flushing and draining (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()

    return stop_signals("shoal simulate", first, None)


def _print_header(config: Any, *, embedded: bool) -> None:
    where = f"embedded broker {config.broker.url}" if embedded else config.broker.url
    print(
        f"shoal simulate: {config.gateways} gateway(s) x {config.sensors} sensors x "
        f"{config.rate_hz:g}/s = {config.offered_rate:,.0f} measurements/s offered, "
        f"{config.encoding.value}{' +zstd' if config.zstd else ''} batches of "
        f"{config.batch_size:,}, {config.duration_s:g} s, spool {config.spool}, "
        + (f"{config.late_share:.1%} late by {config.late_by_ms} ms, " if config.late_share else "")
        + f"sink {config.sink}, {where}",
        file=sys.stderr,
    )


def _print_progress(p: Any) -> None:
    rate = p.rows_published / p.elapsed_s if p.elapsed_s > 0 else 0.0
    sink = f"  sink {p.sink_rows:,}" if p.sink_rows is not None else ""
    print(
        f"[{p.elapsed_s:5.1f}s] offered {p.offered_rows:,}  sealed {p.rows_sealed:,}  "
        f"published {p.rows_published:,} ({rate:,.0f}/s)  batches {p.batches_published:,}  "
        f"{p.bytes_published / 2**20:,.1f} MiB  resends {p.resends}  "
        f"spool {p.spool_batches} ({p.spool_bytes / 2**20:,.1f} MiB)  cpu {p.cpu_percent:.0f}%"
        f"{sink}",
        file=sys.stderr,
        flush=True,
    )


def _print_summary(r: Any) -> None:
    if r.within_tolerance:
        verdict = "OK: within 2% of offered"
    elif r.kept_up:
        verdict = "OK: above offered, catching up (re-sends after reconnects)"
    else:
        verdict = "MISSED: below 98% of offered"
    if not r.all_published:
        delivery = "NOT all accepted by the broker before the drain timeout (exit 1)"
    elif r.confirmed is False:
        delivery = "NOT all confirmed by the pipeline in time (exit 1)"
    elif r.confirmed:
        delivery = "every batch accepted by the broker and confirmed (exit 0)"
    else:
        delivery = "every batch accepted by the broker; confirmations not awaited (exit 0)"
    lines = [
        f"shoal simulate: {'stopped early after' if r.stopped_early else 'ran'} "
        f"{r.duration_s:.1f} s",
        f"  offered    {r.offered_rows:>14,} rows  {r.offered_rate:>12,.0f}/s "
        f"(nominal {r.nominal_rate:,.0f}/s)",
        f"  sealed     {r.rows_sealed:>14,} rows in {r.batches_sealed:,} batches "
        f"({r.splits} splits, {r.rejected} rejected)",
        f"  published  {r.rows_published:>14,} rows  {r.achieved_rate:>12,.0f}/s = "
        f"{100 * r.achieved_ratio:.2f}% of offered [{verdict}]",
        f"  wire       {r.bytes_published / 2**20:,.1f} MiB, {r.bytes_per_row:.2f} bytes/row, "
        f"{r.publishes:,} publishes, {r.resends:,} re-sends",
        f"  spool      peak {r.spool_batches_max:,} batches "
        f"({r.spool_bytes_max / 2**20:,.1f} MiB), {r.spool_batches_end:,} left at the end"
        + ("" if r.confirmed is None else f", all confirmed: {r.confirmed}"),
        f"  delivery   {delivery}",
        f"  cpu        {r.cpu_s:.1f} s over {r.wall_s:.1f} s = {r.cpu_percent:.1f}% of one core "
        f"(simulator process), rss {r.rss_mb:.0f} MiB",
    ]
    if r.rows_made_late:
        lines.append(f"  late       {r.rows_made_late:>14,} rows stamped back (--late-share)")
    if r.observed_cpu:
        others = ", ".join(f"{name} {cpu:.1f}%" for name, cpu in r.observed_cpu.items())
        lines.append(f"  other cpu  {others}")
    if r.sink is not None:
        s = r.sink
        lines.append(
            f"  sink       received {s['rows']:,} rows in {s['batches']:,} batches "
            f"({s['duplicates']} duplicates, {s['errors']} errors)"
        )
    print("\n".join(lines))
