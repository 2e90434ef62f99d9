"""``shoal up``: broker, pipeline, simulated gateways and a live view (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shoal._cli.common import add_embedded_broker_option, add_pipeline_option, load_spec


def register(sub: Any) -> None:
    """Add the ``up`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "up",
        help="run broker + pipeline + simulated gateways with a live view",
        description="Start the embedded Mosquitto, the pipeline's combiners and workers, and "
        "simulated gateways; show rates, lag and results live. Ctrl-C (or --duration) stops "
        "everything cleanly and prints a summary that accounts for every measurement.",
    )
    add_pipeline_option(parser)
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes to start with (default 2)"
    )
    parser.add_argument(
        "--scenario",
        default="A",
        help="simulated gateways: A (1 x 1,000 sensors), B (10 x 1,000) or none (default A)",
    )
    parser.add_argument("--rate", type=float, default=25.0, help="measurements/s per sensor")
    parser.add_argument("--batch", type=int, default=4_000, help="rows per batch (default 4000)")
    parser.add_argument("--encoding", default="binary", help="batch encoding (default binary)")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after N seconds of load, counted from the first measurements (default: Ctrl-C)",
    )
    parser.add_argument("--profile", default="dev", help="broker profile (default dev)")
    add_embedded_broker_option(parser)
    parser.add_argument("--run-dir", type=Path, default=None, help="keep logs and state here")
    parser.add_argument(
        "--view-port",
        type=int,
        default=8580,
        metavar="PORT",
        help="serve the dashboard page (shoal view) here (default 8580, a free one if taken; "
        "-1: no page)",
    )
    parser.add_argument(
        "--no-control-plane",
        dest="control_plane",
        action="store_false",
        help="do not run the control plane (`shoal control`) that `shoal pipeline` talks to",
    )
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="run workers and combiners pinned to this one pipeline (the pre-pool layout) "
        "instead of pool workers and combiners that serve every pipeline deployed with "
        "`shoal pipeline deploy`; implied by --no-control-plane and by profiles with access "
        "control (their component roles name one pipeline)",
    )
    scaling = parser.add_argument_group("scaling")
    scaling.add_argument(
        "--scale",
        default="lag",
        choices=["lag", "cpu", "rps", "off"],
        help="scaling policy for the workers (default lag; off: a fixed --workers)",
    )
    scaling.add_argument("--min-workers", type=int, default=1, help="(default 1)")
    scaling.add_argument("--max-workers", type=int, default=4, help="(default 4)")
    scaling.add_argument(
        "--trace",
        choices=["step", "ramp", "spike"],
        help="simulated load over time instead of a fixed scenario: step is scenario A, then "
        "B, then A again; the run ends with the trace (try --pipeline citywide)",
    )
    scaling.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply the trace's phase lengths (default 1)",
    )
    scaling.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the scaler's Prometheus /metrics and KEDA /api/v1/scaling (0: any port)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run until Ctrl-C, ``--duration`` or the trace ends; exit 0 only if nothing was lost."""
    from shoal.errors import ConfigError  # noqa: PLC0415
    from shoal.runtime.loadtrace import make_trace  # noqa: PLC0415
    from shoal.runtime.up import Up, UpConfig  # noqa: PLC0415
    from shoal.scaler.policy import Bounds  # noqa: PLC0415

    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    try:
        bounds = Bounds(args.min_workers, args.max_workers)
    except ConfigError as exc:
        raise ConfigError(f"--min-workers/--max-workers: {exc}") from exc
    scenario = None if args.scenario.lower() == "none" else args.scenario
    if args.trace is not None and scenario is None:
        raise ConfigError("--trace drives simulated gateways; drop --scenario none")
    if args.time_scale <= 0:
        raise ConfigError("--time-scale must be positive")
    from shoal._cli.common import spec_path  # noqa: PLC0415
    from shoal._resources import resource_dir  # noqa: PLC0415

    has_acl = (resource_dir("broker") / f"{args.profile}.acl").is_file()
    pool = not (args.pinned or not args.control_plane or has_acl)
    config = UpConfig(
        spec=load_spec(args.pipeline),
        spec_source=str(spec_path(args.pipeline)),
        pool=pool,
        workers=args.workers if args.scale == "off" else bounds.clamp(args.workers),
        profile=args.profile,
        scenario=scenario,
        rate=args.rate,
        batch=args.batch,
        encoding=args.encoding,
        duration_s=args.duration,
        run_dir=args.run_dir,
        scale=None if args.scale == "off" else args.scale,
        bounds=bounds,
        trace=None if args.trace is None else make_trace(args.trace).scaled(args.time_scale),
        metrics_port=args.metrics_port,
        control_plane=args.control_plane,
        view_port=None if args.view_port < 0 else args.view_port,
    )
    accounting = Up(config).run()
    return 0 if accounting.exact else 1
