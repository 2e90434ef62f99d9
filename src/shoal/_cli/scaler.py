"""``shoal scaler``: keep a pipeline's worker count matched to its lag."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from shoal._cli.common import (
    add_broker_options,
    add_pipeline_option,
    add_stop_option,
    broker_settings,
    load_spec,
    stop_timeout,
    topics,
)


def register(sub: Any) -> None:
    """Add the ``scaler`` sub-command."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "scaler",
        help="scale a pipeline's workers on lag (local processes or a Kubernetes Deployment)",
        description="Watch the pipeline's exact lag (unconfirmed batches and measurements), "
        "arrival rate and measured worker capacity; start or drain workers accordingly. "
        "Serves Prometheus metrics on /metrics and KEDA metrics-api JSON on /api/v1/scaling.",
    )
    add_pipeline_option(parser)
    parser.add_argument(
        "--pool",
        action="store_true",
        help="scale the worker pool (`shoal worker` without --pipeline) on the sum of the lags "
        "of every pipeline deployed at run time (`shoal pipeline deploy`), not one pipeline",
    )
    add_broker_options(parser)
    parser.add_argument(
        "--policy", default="lag", choices=["lag", "cpu", "rps"], help="default lag"
    )
    parser.add_argument(
        "--min", type=int, default=1, dest="min_workers", help="fewest workers (default 1)"
    )
    parser.add_argument(
        "--max", type=int, default=4, dest="max_workers", help="most workers (default 4)"
    )
    parser.add_argument(
        "--backend",
        default="local",
        choices=["local", "kubernetes", "keda"],
        help="where workers run: local processes, a Kubernetes Deployment the scaler scales, or "
        "one KEDA scales from /api/v1/scaling (the scaler only observes it)",
    )
    parser.add_argument(
        "--deployment", default="shoal-worker", help="kubernetes: the workers' Deployment"
    )
    parser.add_argument("--namespace", default="default", help="kubernetes: its namespace")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between decisions")
    parser.add_argument(
        "--metrics-port",
        "--port",
        dest="port",
        type=int,
        default=9464,
        help="port of /metrics and KEDA's /api/v1/scaling (default 9464; 0: any; -1: none)",
    )
    parser.add_argument(
        "--metrics-host", "--bind", dest="bind", default="127.0.0.1", help="metrics address"
    )
    parser.add_argument(
        "--log-dir", type=Path, default=Path("var/scaler"), help="local workers' logs"
    )
    add_stop_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the scaler until signalled."""
    from shoal._processes import ChildProcess, connection_args, shoal_argv  # noqa: PLC0415
    from shoal._stopping import run_until_signalled  # noqa: PLC0415
    from shoal.runtime.scaler import Scaler, ScalerConfig  # noqa: PLC0415
    from shoal.scaler.backends import Backend, KubernetesBackend, LocalBackend  # noqa: PLC0415
    from shoal.scaler.policy import Bounds  # noqa: PLC0415

    spec = None if args.pool else load_spec(args.pipeline)
    # The pool: `shoal worker` without --pipeline serves whatever is deployed.
    pinned = [] if args.pool else ["--pipeline", args.pipeline]
    settings = broker_settings(args)
    names = topics(args)
    bounds = Bounds(args.min_workers, args.max_workers)
    backend: Backend
    if args.backend in ("kubernetes", "keda"):
        backend = KubernetesBackend(
            args.deployment, args.namespace, read_only=args.backend == "keda"
        )
    else:
        counter = itertools.count()

        def spawn() -> ChildProcess:
            index = next(counter)
            child = ChildProcess(
                f"worker-{index}",
                shoal_argv("worker", *pinned, *connection_args(settings, names)),
                args.log_dir / f"worker-{index}.log",
                {"POLARS_MAX_THREADS": "1"},
            )
            child.start()
            return child

        backend = LocalBackend(spawn)
    config = ScalerConfig(
        spec=spec,
        broker=settings,
        topics=names,
        policy=args.policy,
        bounds=bounds,
        interval_s=args.interval,
        http_port=None if args.port < 0 else args.port,
        http_host=args.bind,
    )
    from shoal.observe import registry_of, render_async  # noqa: PLC0415
    from shoal.observe.collectors import ScalerCollector  # noqa: PLC0415

    scaler = Scaler(config, backend)
    registry = registry_of([ScalerCollector(scaler)])
    scaler.metrics = lambda: render_async(registry)
    run_until_signalled(scaler.run(), scaler.stop, "shoal scaler", grace_s=stop_timeout(args))
    return 0
