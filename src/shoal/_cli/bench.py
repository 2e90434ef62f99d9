"""``shoal bench <name>``: benchmarks run as commands (``encodings``, ``pipeline``, ``floor``, ...).

Each sub-command imports its benchmark module only when it runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from shoal._cli.bench_adapt import register_adapt
from shoal._cli.bench_matrix import register_matrix
from shoal._cli.bench_memory import register_memory
from shoal._cli.bench_pool import register_pool
from shoal._cli.bench_sink import register_sink
from shoal._cli.common import add_embedded_broker_option
from shoal.errors import ConfigError
from shoal.loadtest.bench_kinds import compare_kinds, format_comparison, parse_kinds
from shoal.loadtest.bench_windows import WINDOW_PRESETS, write_variant

if TYPE_CHECKING:
    from shoal.loadtest.bench_pipeline import PipelineBenchConfig


def register(sub: Any) -> None:
    """Add the ``bench`` command and its sub-commands."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="run a benchmark",
        description="Benchmarks that print a table and can write their records as JSON.",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    encodings = benches.add_parser(
        "encodings",
        help="wire size, encode and decode speed of every encoding",
        description="Encode synthetic batches in every encoding and decode them to "
        "DataFrames; report bytes per measurement and measurements per second (medians), "
        "with ratios against JSON rows.",
    )
    encodings.add_argument(
        "--sizes",
        type=_sizes,
        default="4000,16000,64000",
        metavar="N,N,...",
        help="batch sizes in measurements (default 4000,16000,64000)",
    )
    encodings.add_argument(
        "--repeat",
        type=int,
        default=None,
        metavar="N",
        help="timed samples per figure; the median is reported (default 7)",
    )
    encodings.add_argument("--json", type=Path, metavar="FILE", help="also write the records here")
    encodings.set_defaults(run=run_encodings)
    _register_pipeline(benches)
    register_matrix(benches)
    _register_chaos(benches)
    _register_scaling(benches)
    _register_floor(benches)
    register_sink(benches)
    register_adapt(benches)
    register_pool(benches)
    register_memory(benches)


def _register_pipeline(benches: Any) -> None:
    pipeline: argparse.ArgumentParser = benches.add_parser(
        "pipeline",
        help="simulator -> broker -> workers -> combiners on this machine",
        description="Run the whole pipeline as processes on this machine at a fixed offered "
        "rate and report achieved rate, loss and duplication (count oracle), latencies, and "
        "CPU and peak memory per component; with alerts in the spec, also how long after each "
        "window's result its alert transitions come (alert_after_result_ms). --max steps the "
        "rate up to the highest sustained. Achieved is read from the combiner's count of "
        "applied measurements (its slope over the window's heartbeats), which grows by whole "
        "batches: the simulated gateways seal out of step, and batches that would not fill "
        "within 1 s are sealed by age often enough that either end of the window is off by at "
        "most 0.5 % of the offered rate (the age stays >= 100 ms: one gateway in short runs "
        "reads coarser; batches that fill first keep their size). The record says how "
        "(sealing: max_delay_ms, fill_ms, span_ms, sealed_by, staggered, resolution).",
    )
    add_embedded_broker_option(pipeline)
    pipeline.add_argument(
        "--pipeline", default="default", metavar="NAME|FILE", help="pipeline spec"
    )
    pipeline.add_argument(
        "--scenario", default="B", choices=["A", "B"], help="A: 1 x 1,000 sensors; B: 10 x 1,000"
    )
    pipeline.add_argument(
        "--rate", type=float, default=25.0, help="measurements/s per sensor (default 25)"
    )
    pipeline.add_argument(
        "--batch", type=int, default=16_000, help="rows per batch (default 16000)"
    )
    pipeline.add_argument("--encoding", default="binary", help="batch encoding (default binary)")
    pipeline.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    pipeline.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of measured load per run (default 30; 20 per --max step)",
    )
    pipeline.add_argument(
        "--sensors",
        type=int,
        default=None,
        metavar="N",
        help="sensors per gateway, overriding the scenario's 1,000 (keys = gateways x N)",
    )
    pipeline.add_argument(
        "--window",
        default=None,
        metavar="KIND[,KIND...]",
        help="replace the pipeline's windows by one preset window of this kind "
        "(shoal.loadtest.bench_windows.WINDOW_PRESETS: " + ", ".join(sorted(WINDOW_PRESETS)) + "); "
        "several kinds (e.g. tumbling,sliding,count) run one after another in this invocation "
        "and each is reported against the first (docs/benchmarks.md, 'Window kinds')",
    )
    pipeline.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="with several --window kinds: run them all N times, interleaved, and report "
        "medians and per-round ratios to the first kind (default 1)",
    )
    pipeline.add_argument(
        "--max",
        action="store_true",
        help="find the highest sustained rate: start at --rate, step up 1.6 x while sustained"
        " (a first step that fails runs once more, then the search steps down while not"
        " sustained), then bisect; at low rates each step's gateways seal by age often "
        "enough to read achieved to 0.5 %% (sealing in the record), so low rates over many keys "
        "are measured too",
    )
    pipeline.add_argument(
        "--no-key-topics", action="store_true", help="skip per-key retained results"
    )
    pipeline.add_argument(
        "--gateway-spool",
        choices=["memory", "disk"],
        default="memory",
        help="simulated gateways' spool (default memory: gateways are separate devices)",
    )
    pipeline.add_argument("--json", type=Path, metavar="FILE", help="also write the record(s) here")
    pipeline.add_argument(
        "--run-dir",
        type=Path,
        help="keep logs, spools and checkpoints here (a new or empty folder; not with --max)",
    )
    pipeline.set_defaults(run=run_pipeline)


def _register_scaling(benches: Any) -> None:
    scaling: argparse.ArgumentParser = benches.add_parser(
        "scaling",
        help="scaling policies under a load trace, through the real pipeline",
        description="Drive a load trace (step: scenario A -> B at 25/s -> A) through the "
        "pipeline with the local backend, once per policy, and report max lag, time to lag "
        "below 1 s of data, p99 apply latency, scale events, worker-seconds, and exact loss "
        "and duplication. With --policy all the policies run one after another on the same "
        "trace and a comparison table follows.",
    )
    scaling.add_argument("--trace", default="step", choices=["step", "ramp", "spike"])
    scaling.add_argument(
        "--policy", default="all", choices=["lag", "cpu", "rps", "all"], help="(default all)"
    )
    scaling.add_argument(
        "--pipeline",
        default="citywide",
        metavar="NAME|FILE",
        help="pipeline spec (default citywide: per-type rolling minute, heavy on workers)",
    )
    scaling.add_argument("--sensors", type=int, default=1000, help="sensors per gateway")
    scaling.add_argument("--rate", type=float, default=25.0, help="measurements/s per sensor")
    scaling.add_argument("--batch", type=int, default=16_000, help="rows per batch")
    scaling.add_argument("--encoding", default="binary", help="batch encoding (default binary)")
    scaling.add_argument("--min-workers", type=int, default=1)
    scaling.add_argument("--max-workers", type=int, default=8)
    scaling.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply the trace's phase lengths (0.5: twice as fast; default 1)",
    )
    scaling.add_argument("--json", type=Path, metavar="FILE", help="write figures and samples")
    scaling.add_argument("--plot", type=Path, metavar="PNG", help="plot workers and lag")
    scaling.add_argument("--run-dir", type=Path, help="keep logs and state here")
    scaling.set_defaults(run=run_scaling)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers: {text!r}")
    return sizes


def run_encodings(args: argparse.Namespace) -> int:
    """Run the encoding benchmark, print the table, optionally write JSON."""
    from shoal.loadtest import bench_encodings as bench  # noqa: PLC0415 - heavy, run-time only

    repeats = bench.DEFAULT_REPEATS if args.repeat is None else args.repeat
    if repeats < 1:
        raise ConfigError("--repeat must be at least 1")
    facts = bench.machine()
    print(f"shoal bench encodings\n{bench.describe(facts, repeats)}\n", flush=True)
    results = bench.run(
        args.sizes,
        repeats,
        progress=lambda r: print(f"  measured {r.codec} x {r.batch_size}", file=sys.stderr),
    )
    print(bench.format_table(results))
    if args.json is not None:
        records = [{**r.as_record(), "machine": facts.as_record()} for r in results]
        args.json.write_bytes(orjson.dumps(records, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"\nwrote {len(records)} records to {args.json}")
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    """Run the pipeline benchmark (one rate, or ``--max``; several window kinds compared)."""
    from shoal._cli.common import spec_path  # noqa: PLC0415
    from shoal.loadtest import bench_pipeline as bench  # noqa: PLC0415 - heavy, run-time only

    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    if args.sensors is not None and args.sensors < 1:
        raise ConfigError("--sensors must be at least 1")
    used = args.run_dir is not None and args.run_dir.exists() and any(args.run_dir.iterdir())
    if args.run_dir is not None and (args.max or used):
        raise ConfigError("--run-dir needs a new or empty folder and one run (not --max)")
    kinds = None if args.window is None else parse_kinds(args.window)
    if kinds is not None and (len(kinds) > 1 or args.rounds > 1):
        return _compare_kinds(args, kinds)
    if args.rounds != 1:
        raise ConfigError("--rounds needs --window KIND[,KIND...]")
    source = spec_path(args.pipeline)
    if args.window is not None:
        source = write_variant(source, args.window, Path(tempfile.mkdtemp(prefix="shoal-bench-")))
        print(f"pipeline {args.pipeline} with one {args.window} window: {source}", flush=True)
    config = _pipeline_config(args, source, args.window)
    if args.max:
        result = bench.run_max(config, sys.stderr)
        best = result["best"]
        print(f"\nhighest sustained rate: {result['max_sustained_meas_per_s']:,.0f} meas/s")
        if best is not None:
            print(bench.format_record(best))
        code = 0 if best is not None else 1
    else:
        result = bench.run_pipeline(config, sys.stderr)
        print(bench.format_record(result))
        code = (
            0 if result["lost_measurements"] == 0 and result["duplicated_measurements"] == 0 else 1
        )
    if args.json is not None:
        args.json.write_text(bench.dumps(result) + "\n")
        print(f"wrote {args.json}")
    return code


def _compare_kinds(args: argparse.Namespace, kinds: tuple[str, ...]) -> int:
    """``--window A,B,...``: every kind in turn, ``--rounds`` times; figures against ``A``."""
    from shoal._cli.common import spec_path  # noqa: PLC0415
    from shoal.loadtest import bench_pipeline as bench  # noqa: PLC0415 - heavy, run-time only

    if args.run_dir is not None:
        raise ConfigError("--run-dir needs one run (not several --window kinds or --rounds)")
    folder = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    sources = {k: write_variant(spec_path(args.pipeline), k, folder) for k in kinds}
    print(f"pipeline {args.pipeline} with one window of each kind: {folder}", flush=True)

    def run_one(kind: str) -> dict[str, Any]:
        config = _pipeline_config(args, sources[kind], kind)
        if args.max:
            return bench.run_max(config, sys.stderr)
        return bench.run_pipeline(config, sys.stderr)

    result = compare_kinds(kinds, args.rounds, run_one, sys.stderr)
    result["machine"] = bench.machine()
    print(format_comparison(result))
    if args.json is not None:
        args.json.write_text(bench.dumps(result) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(row["exact"] for row in result["summary"].values()) else 1


def _pipeline_config(
    args: argparse.Namespace, source: Path, kind: str | None
) -> PipelineBenchConfig:
    """The ``PipelineBenchConfig`` of one run of ``shoal bench pipeline``."""
    from shoal.loadtest import bench_pipeline as bench  # noqa: PLC0415 - heavy, run-time only
    from shoal.processors.spec import load_pipeline  # noqa: PLC0415

    return bench.PipelineBenchConfig(
        spec=load_pipeline(source),
        spec_source=str(source),
        window_kind=kind,
        sensors_per_gateway=args.sensors,
        scenario=args.scenario,
        rate=args.rate,
        batch=args.batch,
        encoding=args.encoding,
        workers=args.workers,
        duration_s=args.duration or (20.0 if args.max else 30.0),
        per_key_results=not args.no_key_topics,
        gateway_spool=args.gateway_spool,
        run_dir=args.run_dir,
    )


def run_scaling(args: argparse.Namespace) -> int:
    """Run the scaling benchmark; exit 0 when every policy lost and duplicated nothing."""
    from shoal._cli.common import load_spec  # noqa: PLC0415
    from shoal.loadtest import bench_scaling as bench  # noqa: PLC0415 - heavy, run-time only
    from shoal.runtime.loadtrace import GatewayLoad, make_trace  # noqa: PLC0415
    from shoal.scaler.policy import POLICIES, Bounds  # noqa: PLC0415

    try:
        bounds = Bounds(args.min_workers, args.max_workers)
    except ConfigError as exc:
        raise ConfigError(f"--min-workers/--max-workers: {exc}") from exc
    if args.time_scale <= 0:
        raise ConfigError("--time-scale must be positive")
    spec = load_spec(args.pipeline)
    config = bench.ScalingBenchConfig(
        spec=spec,
        spec_source=args.pipeline,
        trace=make_trace(args.trace).scaled(args.time_scale),
        load=GatewayLoad(
            sensors=args.sensors,
            rate=args.rate,
            batch=args.batch,
            encoding=args.encoding,
            attributes=spec.key != "sensor_id",
            spool="memory",
        ),
        policies=POLICIES if args.policy == "all" else (args.policy,),
        bounds=bounds,
        run_dir=args.run_dir,
    )
    print(f"shoal bench scaling\n{bench.describe_trace(config)}\n", flush=True)
    runs = bench.run(config, sys.stderr)
    print(bench.format_table(runs, config.trace))
    if args.json is not None:
        args.json.write_bytes(bench.to_json(config, runs))
        print(f"wrote {args.json}")
    if args.plot is not None:
        bench.plot(runs, config.trace, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r.accounting.lost == 0 and r.accounting.duplicated == 0 for r in runs) else 1


def _register_floor(benches: Any) -> None:
    floor: argparse.ArgumentParser = benches.add_parser(
        "floor",
        help="the latency floor of one batch: process wakeup, one broker hop, worker handling",
        description="Measure, at scenario A's pace (a batch every 160 ms), what every brokered "
        "pipeline pays per batch on this machine: a process woken by a socket write, one QoS 1 "
        "message through Mosquitto between two shoal sessions, and a worker's handling of a "
        "batch (warm and after idling). Prints p50/p95/p99/max in ms.",
    )
    add_embedded_broker_option(floor)
    floor.add_argument(
        "--pipeline", default="baseline-equivalent", metavar="NAME|FILE", help="pipeline spec"
    )
    floor.add_argument("--batch", type=int, default=4_000, help="rows per batch (default 4000)")
    floor.add_argument(
        "--period-ms", type=float, default=160.0, help="time between batches (default 160)"
    )
    floor.add_argument("--samples", type=int, default=200, help="samples per measure (default 200)")
    floor.add_argument("--json", type=Path, metavar="FILE", help="also write the record here")
    floor.set_defaults(run=run_floor)


def run_floor(args: argparse.Namespace) -> int:
    """Run the latency-floor benchmark."""
    from shoal._cli.common import load_spec  # noqa: PLC0415
    from shoal.loadtest import bench_encodings  # noqa: PLC0415 - heavy, run-time only
    from shoal.loadtest import bench_floor as bench  # noqa: PLC0415

    if args.samples < 1 or args.batch < 1 or args.period_ms <= 0:
        raise ConfigError("--samples, --batch and --period-ms must be positive")
    spec = load_spec(args.pipeline)
    print(f"shoal bench floor (pipeline {spec.name})", flush=True)
    result = bench.run(
        spec,
        period_ms=args.period_ms,
        samples=args.samples,
        rows=args.batch,
        progress=lambda line: print(f"  measuring {line}", file=sys.stderr, flush=True),
    )
    print(bench.format_report(result))
    if args.json is not None:
        record = {**result.as_record(), "machine": bench_encodings.machine().as_record()}
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}")
    return 0


def _register_chaos(benches: Any) -> None:
    chaos: argparse.ArgumentParser = benches.add_parser(
        "chaos",
        help="the pipeline under kill -9, broker restarts, pauses and overload",
        description="Run the pipeline as processes on this machine under repeated faults: kill "
        "-9 of random workers and combiners, a broker SIGKILL and restart, worker pauses "
        "(SIGSTOP/SIGCONT), a gateway restart, and an overload at twice the measured capacity "
        "with the workers at the scaler's maximum. Accounts for every measurement (published, "
        "applied, in results, late, lost, duplicated) and reports peak memory per component. "
        "Exit status 0 only if nothing was lost or duplicated and memory stayed bounded.",
    )
    add_embedded_broker_option(chaos)
    chaos.add_argument("--duration", type=float, default=120.0, help="seconds (default 120)")
    chaos.add_argument("--min-workers", type=int, default=2, help="scaler minimum (default 2)")
    chaos.add_argument("--max-workers", type=int, default=4, help="scaler maximum (default 4)")
    chaos.add_argument(
        "--rate", type=float, default=20.0, help="base load per sensor, 2 x 500 sensors (20/s)"
    )
    chaos.add_argument(
        "--kill-interval", type=float, default=5.0, help="seconds between kills (default 5)"
    )
    chaos.add_argument(
        "--capacity",
        type=float,
        default=None,
        metavar="MEAS_PER_S",
        help="skip the capacity probe and use this capacity",
    )
    chaos.add_argument(
        "--overload", type=float, default=12.0, help="seconds of overload (default 12)"
    )
    chaos.add_argument(
        "--no-scaler", action="store_true", help="fixed maximum workers instead of the scaler"
    )
    chaos.add_argument(
        "--profile", default="dev", help="broker profile (secure: every component with its role)"
    )
    chaos.add_argument("--seed", type=int, default=0, help="choice of victims")
    chaos.add_argument(
        "--late-share",
        type=float,
        default=0.002,
        metavar="FRACTION",
        help="share of base-load measurements stamped 5 s back, folded in as corrections "
        "through the kills (default 0.002; 0: none, and no allowed lateness)",
    )
    chaos.add_argument(
        "--rss-limit-mb", type=float, default=1500.0, help="peak RSS allowed per component"
    )
    chaos.add_argument("--keep", type=Path, metavar="DIR", help="keep logs and spools in DIR")
    chaos.add_argument("--json", type=Path, metavar="FILE", help="also write the record here")
    chaos.set_defaults(run=run_chaos)


def run_chaos(args: argparse.Namespace) -> int:
    """Run the chaos benchmark, print the summary, optionally write JSON."""
    from shoal.loadtest import chaos  # noqa: PLC0415 - heavy, run-time only

    if not 1 <= args.min_workers <= args.max_workers:
        raise ConfigError("need 1 <= --min-workers <= --max-workers")
    if args.duration < 20:
        raise ConfigError("--duration must be at least 20 seconds")
    config = chaos.ChaosConfig(
        duration_s=args.duration,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        rate_hz=args.rate,
        kill_interval_s=args.kill_interval,
        capacity=args.capacity,
        overload_s=args.overload,
        scaler=not args.no_scaler,
        profile=args.profile,
        seed=args.seed,
        late_share=args.late_share,
        rss_limit_mb=args.rss_limit_mb,
        run_dir=args.keep,
    )
    print(f"shoal bench chaos: {args.duration:g} s", file=sys.stderr, flush=True)
    record = chaos.run_chaos(config, sys.stderr)
    print(chaos.format_record(record))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {args.json}")
    return 0 if record["exact"] and record["memory"]["bounded"] else 1
