"""``shoal pipeline``: deploy, list, show, update and delete pipelines at run time."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

from shoal._cli.common import add_broker_options, broker_settings, topics
from shoal.errors import ConfigError, ControlError

if TYPE_CHECKING:
    from shoal.control.client import ControlClient
    from shoal.control.messages import PipelineDocument, Result

NOT_YET_RUNNING = (
    "deploy and update return once the control plane stored the version, a pool worker "
    "(`shoal worker` without --pipeline) reports serving it (subscribed, its handler "
    "built) and pool combiners (`shoal combiner` without --pipeline) own every partition "
    "(session taken, checkpoint restored), or fail with not_served / not_owned after "
    "--timeout; --no-wait returns once it is stored; --no-combiners does not wait for "
    "combiners (for pipelines run by `shoal combiner --pipeline FILE`)."
)


HEALTH_LISTEN_S: Final = 1.5
"""How long ``list`` listens to worker heartbeats (sent every second) for functions' health."""


def register(sub: Any) -> None:
    """Add the ``pipeline`` sub-command and its actions."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "pipeline",
        help="deploy, list, show, update and delete pipelines at run time",
        description=(
            "Talk to the control plane (`shoal control`) over MQTT. Exit 0 when accepted, 1 "
            "when refused (one line: the reason and the spec field), 2 on a broker error or "
            f"when no control plane answers within --timeout. {NOT_YET_RUNNING}"
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("deploy", "deploy a new pipeline from a TOML spec (FILE, or - for stdin)"),
        ("update", "replace a deployed pipeline's spec (a new version)"),
    ):
        action = actions.add_parser(
            name, help=help_text, description=f"{help_text}. {NOT_YET_RUNNING}"
        )
        action.add_argument("file", metavar="FILE|-", help="pipeline spec (TOML); - reads stdin")
        action.add_argument(
            "--no-wait",
            action="store_true",
            help="return once the control plane stored it; do not wait for a pool worker",
        )
        action.add_argument(
            "--no-combiners",
            action="store_true",
            help="wait for a pool worker only, not for pool combiners to own every partition",
        )
        _common(action)
    delete = actions.add_parser("delete", help="delete a deployed pipeline")
    delete.add_argument("name", metavar="NAME")
    _common(delete)
    show = actions.add_parser("show", help="show a deployed pipeline's version and spec")
    show.add_argument("name", metavar="NAME")
    _common(show)
    _common(actions.add_parser("list", help="list the deployed pipelines"))
    flush = actions.add_parser(
        "flush",
        help="close every open window of a pipeline now (its combiner partitions emit them)",
        description="Every combiner partition of the pipeline (of the computation an alias "
        "shares) closes and publishes its open windows, then confirms once the broker has "
        "them. Exit 0 when every partition confirmed, 1 when the pipeline is not deployed, 2 "
        "when not every partition confirmed within --timeout (not_flushed).",
    )
    flush.add_argument("name", metavar="NAME")
    flush.add_argument(
        "--no-wait",
        action="store_true",
        help="return once the command is published; do not wait for the partitions to confirm",
    )
    _common(flush)
    drain = actions.add_parser(
        "drain",
        help="drain pool workers without losing a batch (all of them, or --worker ID)",
        description="Each pool worker leaves every subscription group, handles what the broker "
        "had queued for it, acknowledges and exits. Exit 0 once every one is gone, 2 if not "
        "within --timeout (not_drained) or if no pool worker is seen (no_workers).",
    )
    drain.add_argument(
        "--worker", action="append", metavar="ID", help="this pool worker only (repeatable)"
    )
    _common(drain)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the control plane's answer, and then (deploy, update) "
        "for a pool worker to serve the version and pool combiners to own it (default 10 each)",
    )
    add_broker_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one action; see the exit codes in ``--help``."""
    from shoal.control.client import ControlClient  # noqa: PLC0415

    client = ControlClient(broker_settings(args), topics(args), timeout_s=args.timeout)
    try:
        if args.action in ("list", "show"):
            return _read(client, args)
        if args.action == "flush":
            return _flush(client, args)
        if args.action == "drain":
            return _drain(client, args)
        return _request(client, args)
    except ControlError as exc:
        if args.json:
            _print_json(
                {"ok": False, "reason": exc.reason, "field": exc.field, "message": str(exc)}
            )
        print(f"shoal pipeline {args.action}: {exc.reason}: {exc}", file=sys.stderr)
        return 2


def _request(client: ControlClient, args: argparse.Namespace) -> int:
    from shoal.control.messages import Request  # noqa: PLC0415

    request_id = uuid.uuid4().hex
    if args.action == "delete":
        request = Request("delete", request_id, name=args.name)
    else:
        request = Request(args.action, request_id, spec_toml=_read_spec(args.file))
    result = asyncio.run(client.request(request))
    if not result.ok:
        if args.json:
            _print_json(result.as_dict())
        where = f" (field {result.field})" if result.field else ""
        print(
            f"shoal pipeline {args.action}: refused: {result.reason}{where}: {result.message}",
            file=sys.stderr,
        )
        return 1
    if args.action == "delete" or args.no_wait:
        confirmed = _confirmed(None, None)
        if args.json:
            _print_json({**result.as_dict(), "confirmed": confirmed})
        else:
            print(_accepted(result))
        return 0
    return _wait_served(client, args, result)


def _wait_served(client: ControlClient, args: argparse.Namespace, result: Result) -> int:
    """Wait until the version is served by a pool worker and owned by pool combiners.

    Exit 2 (not_served, not_owned) if that does not happen in time.
    """
    assert result.name is not None  # an accepted deploy or update names its pipeline
    assert result.version is not None
    # An alias runs nothing of its own: it is running once the computation it shares is.
    name, version = result.name, result.version
    if result.alias_of is not None:
        name, version = result.alias_of, 1
    workers: list[str] = []
    owners: dict[int, str] | None = None if args.no_combiners else {}
    try:
        workers = asyncio.run(client.served(name, version))
        if owners is not None:
            owners = asyncio.run(client.owned(name, version))
    except ControlError as exc:
        if args.json:
            failed = {**result.as_dict(), "confirmed": _confirmed(workers, owners)}
            _print_json({**failed, "running": False, "reason": exc.reason, "message": str(exc)})
        print(f"shoal pipeline {args.action}: {exc.reason}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json({**result.as_dict(), "confirmed": _confirmed(workers, owners)})
    else:
        print(f"{_accepted(result)}; served by pool worker(s) {', '.join(workers)}")
        if owners is None:
            print("combiners: not waited for (--no-combiners)")
        else:
            named = ", ".join(f"{p}: {m}" for p, m in sorted(owners.items()))
            print(f"partitions owned by pool combiner(s): {named}")
    return 0


def _flush(client: ControlClient, args: argparse.Namespace) -> int:
    """Exit 0 once every partition confirmed (--no-wait: once the command is published).

    1: not deployed; 2: not every partition confirmed within --timeout, or broker trouble.
    """
    try:
        flushed = asyncio.run(client.flush(args.name, wait=not args.no_wait))
    except ControlError as exc:
        if exc.reason != "unknown_pipeline":
            raise
        if args.json:
            _print_json({"ok": False, "reason": exc.reason, "field": "name", "message": str(exc)})
        print(f"shoal pipeline flush: refused: {exc.reason}: {exc}", file=sys.stderr)
        return 1
    computation = flushed.computation
    if args.no_wait:
        if args.json:
            _print_json({"ok": True, **flushed.as_dict(), "confirmed": None})
        else:
            print(f"flush sent to the combiner partitions of {computation!r} (not waited for)")
        return 0
    if flushed.missing:
        message = (
            f"partition(s) {flushed.missing} of {computation!r} did not confirm the flush within "
            f"{args.timeout:g} s ({len(flushed.replies)} of {flushed.partitions} did); is a "
            "combiner running for them (`shoal combiner`)?"
        )
        if args.json:
            _print_json(
                {"ok": False, "reason": "not_flushed", "message": message, **flushed.as_dict()}
            )
        print(f"shoal pipeline flush: not_flushed: {message}", file=sys.stderr)
        return 2
    if args.json:
        _print_json({"ok": True, **flushed.as_dict()})
    else:
        by = ", ".join(
            f"{p}: {r.get('owner') or r.get('combiner')}"
            for p, r in sorted(flushed.replies.items())
        )
        print(
            f"flushed {computation!r}: {flushed.windows} window(s) published; partitions "
            f"confirmed by {by}"
        )
    return 0


def _drain(client: ControlClient, args: argparse.Namespace) -> int:
    drained = asyncio.run(client.drain(args.worker))
    if args.json:
        _print_json({"ok": True, "workers": drained})
    else:
        print(f"drained pool worker(s): {', '.join(sorted(drained))}")
    return 0


def _confirmed(workers: list[str] | None, owners: dict[int, str] | None) -> dict[str, Any]:
    """What ``--json`` says was confirmed: stored, pool workers, each partition's combiner.

    ``workers`` and ``owners`` are None when not waited for.
    """
    return {
        "stored": True,
        "workers": workers,  # None: not waited for (--no-wait, delete)
        "combiners": None if owners is None else {str(p): m for p, m in sorted(owners.items())},
    }


def _accepted(result: Result) -> str:
    return f"{result.message} ({result.change}; {result.spec_hash or 'no spec'})"


def _read_spec(file: str) -> str:
    """The spec's text, with the code of ``[functions.x] file = ...`` inlined (from its folder)."""
    from shoal.control.canonical import inline_files  # noqa: PLC0415

    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read pipeline spec {file}: {exc}") from exc
    return inline_files(text, Path.cwd() if file == "-" else Path(file).parent)


def _read(client: ControlClient, args: argparse.Namespace) -> int:
    documents = [d for d in asyncio.run(client.documents()) if d.deployed]
    if args.action == "list":
        # Pipelines with user functions: listen to one round of worker and combiner heartbeats
        # for their health (a pipeline is degraded after degrade_after consecutive failed
        # batches in a worker, or failed UDAF calls in a combiner).
        with_functions = any(d.spec and d.spec.get("functions") for d in documents)
        health = asyncio.run(client.function_health(HEALTH_LISTEN_S)) if with_functions else {}
        if args.json:
            _print_json({"pipelines": [_summary(d, documents, health) for d in documents]})
        else:
            for d in documents:
                state = "\tdegraded" if health.get(d.name, {}).get("degraded") else ""
                print(f"{d.name}\tv{d.version}\t{d.spec_hash}\t{_sharing(d, documents)}{state}")
        return 0
    match = next((d for d in documents if d.name == args.name and d.named), None)
    if match is None:
        raise ControlError(f"pipeline {args.name!r} is not deployed", reason="unknown_pipeline")
    if args.json:
        _print_json(match.as_dict())
    else:
        print(f"{match.name} v{match.version} {match.spec_hash}")
        _print_json(match.spec)
    return 0


def _summary(
    document: PipelineDocument,
    documents: list[PipelineDocument],
    health: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One entry of ``list --json``: the document and how its computation is shared.

    ``computation``: the pipeline that computes its results (itself, or the one it is an alias
    of); ``names``: every name the computation's results are published under; ``refs``: how
    many (the reference count); ``released``: the name was deleted, it computes for aliases.
    With user functions: ``degraded`` and the ``functions`` health its workers and combiners
    report, by their client id (under ``functions``).
    """
    computation = document.alias_of or document.name
    names = sorted(d.name for d in documents if computation in (d.alias_of, d.name) and d.named)
    summary: dict[str, Any] = {
        "name": document.name,
        "version": document.version,
        "hash": document.spec_hash,
        "changed_at_ms": document.changed_at_ms,
        "alias_of": document.alias_of,
        "released": document.released,
        "computation": computation,
        "names": names,
        "refs": len(names),
    }
    if health is not None and document.spec and document.spec.get("functions"):
        mine = health.get(document.name)
        summary["degraded"] = bool(mine and mine["degraded"])
        summary["functions"] = None if mine is None else mine["workers"]
    return summary


def _sharing(document: PipelineDocument, documents: list[PipelineDocument]) -> str:
    summary = _summary(document, documents)
    if document.released:
        return f"deleted; computes for {', '.join(summary['names'])}"
    if summary["refs"] > 1:
        return f"shared by {', '.join(summary['names'])} (computed as {summary['computation']})"
    return ""


def _print_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")
