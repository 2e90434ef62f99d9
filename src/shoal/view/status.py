"""What ``shoal status`` reports: a pipeline's workers, lag, and why its windows are (not) closing.

Pure: a ``Snapshot`` of the ``PipelineMonitor`` in, a JSON-ready dict out (``pipeline_status``),
and the same as text (``format_status``). Per gateway it merges what the gateway announces
(seqs, unconfirmed batches) with what every combiner partition reports in its heartbeat
(``gateway_progress``: watermark, whether it holds the pipeline watermark, for how long it has
kept the others waiting, whether it was released, refused batches, clock offset), so that a
user can see which gateway a window is waiting for without reading raw MQTT messages.
Never imports MQTT.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from shoal.scaler.monitor import Snapshot


def pipeline_status(pipeline: str, snap: Snapshot, listened_s: float) -> dict[str, Any]:
    """The status document of ``pipeline`` (see the module docstring).

    ``listened_s``: how long the snapshot's monitor listened; late rows and dead letters are
    counted over that time only (they are not retained by the broker).
    """
    partitions = [_partition(p, beat, snap.at_ms) for p, beat in sorted(snap.combiners.items())]
    workers = [
        {
            "id": wid,
            "state": body.get("state"),
            "rows_per_s": body.get("rows_per_s"),
            "cpu_percent": body.get("cpu_percent"),
            "rows_clamped": int(body.get("rows_clamped", 0)),
        }
        for wid, body in sorted(snap.worker_metrics.items())
    ]
    return {
        "pipeline": pipeline,
        "at": snap.at_ms,
        "workers": workers,
        "clamped_measurements": sum(w["rows_clamped"] for w in workers),
        "rates": {
            "in_per_s": round(snap.rows_in_per_s, 1),
            "out_per_s": round(snap.rows_out_per_s, 1),
        },
        "lag": {
            "batches": snap.lag_batches,
            "measurements": snap.lag_rows,
            "oldest_unconfirmed_age_ms": snap.oldest_unconfirmed_age_ms,
        },
        "partitions": partitions,
        "gateways": _gateways(snap),
        "listened_s": listened_s,
        "late_measurements_while_listening": snap.late_rows,
        "dead_letters_while_listening": snap.deadletters,
        **_functions(pipeline, snap),
    }


def _functions(pipeline: str, snap: Snapshot) -> dict[str, Any]:
    """``functions`` and ``degraded``, for a pipeline whose workers report user functions."""
    # Workers report their guarded batches, combiners their UDAF merge/finalize calls.
    beats = [
        *snap.worker_metrics.items(),
        *((str(b.get("id")), b) for b in snap.combiners.values()),
    ]
    reports = {
        wid: body["functions"][pipeline]
        for wid, body in sorted(beats, key=lambda beat: beat[0])
        if isinstance(body.get("functions"), dict) and pipeline in body["functions"]
    }
    if not reports:
        return {}
    failures: dict[str, int] = {}
    for report in reports.values():
        for reason, count in (report.get("failures") or {}).items():
            failures[reason] = failures.get(reason, 0) + int(count)
    return {
        "degraded": any(bool(r.get("degraded")) for r in reports.values()),
        "functions": {"failed_batches": failures, "workers": reports},
    }


def _partition(partition: int, beat: dict[str, Any], now_ms: int) -> dict[str, Any]:
    progress: dict[str, dict[str, Any]] = beat.get("gateway_progress") or {}
    holding = {g: p for g, p in progress.items() if p.get("holding")}
    marks = [p.get("watermark") for p in holding.values()]
    if holding and any(m is None for m in marks):
        waiting_for = sorted(g for g, p in holding.items() if p.get("watermark") is None)
        why = "waiting for the first accepted data of " + ", ".join(waiting_for)
    elif holding:
        lowest = min(m for m in marks if m is not None)
        waiting_for = sorted(g for g, p in holding.items() if p.get("watermark") == lowest)
        why = f"watermark held at {_when(lowest)} by " + ", ".join(waiting_for)
    else:
        waiting_for = []
        why = "no gateway holds the watermark (all idle): windows close up to the newest data"
    return {
        "partition": partition,
        "owner": beat.get("owner"),
        "watermark": beat.get("watermark"),
        "closed_through": beat.get("closed_through"),
        "max_hold_ms": beat.get("max_hold_ms"),
        "pending_batches": beat.get("pending_batches"),
        "partials_refused": int(beat.get("partials_refused", 0)),
        "allowed_lateness_ms": int(beat.get("allowed_lateness_ms", 0)),
        "kept_windows": int(beat.get("kept_windows", 0)),
        "corrections_emitted": int(beat.get("corrections_emitted", 0)),
        "rows_corrected": int(beat.get("rows_corrected", 0)),
        "heartbeat_age_ms": max(0, now_ms - int(beat.get("at", now_ms))),
        "waiting_for": waiting_for,
        "why": why,
    }


def _gateways(snap: Snapshot) -> list[dict[str, Any]]:
    """Per gateway: its lag, and the worst of what the partitions say about it."""
    lag = {g.gateway_id: g for g in snap.lag}
    views: dict[str, list[dict[str, Any]]] = {}
    for beat in snap.combiners.values():
        for gateway_id, view in (beat.get("gateway_progress") or {}).items():
            views.setdefault(gateway_id, []).append(view)
    out = []
    for gateway_id in sorted(set(lag) | set(views)):
        seen = views.get(gateway_id, [])
        marks = [int(v["watermark"]) for v in seen if v.get("watermark") is not None]
        offsets = [int(v["clock_offset_ms"]) for v in seen if v.get("clock_offset_ms") is not None]
        gateway_lag = lag.get(gateway_id)
        watermark = min(marks) if marks else None
        out.append(
            {
                "id": gateway_id,
                "unconfirmed_batches": gateway_lag.batches if gateway_lag else None,
                "unconfirmed_measurements": gateway_lag.rows if gateway_lag else None,
                "watermark": watermark,
                "event_time_behind_ms": None if watermark is None else snap.at_ms - watermark,
                "holding": any(v.get("holding") for v in seen),
                "holding_others_ms": max((v.get("holding_others_ms", 0) for v in seen), default=0),
                "released": any(v.get("released") for v in seen),
                "refused_batches": max((v.get("refused_batches", 0) for v in seen), default=0),
                "clock_offset_ms": round(sum(offsets) / len(offsets)) if offsets else None,
            }
        )
    return out


def gateway_notes(status: dict[str, Any], *, durations: bool = True) -> dict[str, str]:
    """Per notable gateway, one line on its event time (for the ``shoal up`` view).

    Notable: released from holding, holding the others back, refused batches, or a clock
    offset of a second or more. ``durations=False`` leaves out what changes every second
    (how long it has held), so that a change of the text is a change of state.
    """
    notes = {}
    for g in status["gateways"]:
        parts = []
        if g["released"]:
            parts.append("released from holding (its windows closed without it)")
        if g["holding_others_ms"]:
            held = f" for {_ms(g['holding_others_ms'])}" if durations else ""
            parts.append(f"keeping the others' windows open{held}")
        if g["refused_batches"]:
            count = f"{g['refused_batches']} " if durations else ""
            parts.append(f"{count}batches refused")
        offset = g["clock_offset_ms"]
        if offset is not None and abs(offset) >= 1_000:
            ahead = "behind" if offset > 0 else "ahead"  # arrival minus its own stamp
            parts.append(f"clock {_ms(abs(offset))} {ahead}")
        if parts:
            notes[g["id"]] = ", ".join(parts)
    return notes


def partition_notes(partition: dict[str, Any]) -> str:
    """What else a partition's line says (``""`` when there is nothing to say).

    Refused partials, and late corrections when the spec allows them.
    """
    notes = ""
    refused = partition["partials_refused"]
    if refused:
        notes += f"; {refused:,} partial{'s' if refused != 1 else ''} refused (see its log)"
    if partition["allowed_lateness_ms"] > 0:
        notes += (
            f"; corrections: {partition['corrections_emitted']:,} revised results, "
            f"{partition['rows_corrected']:,} late measurements folded in, "
            f"{partition['kept_windows']:,} closed windows kept "
            f"(allowed lateness {_ms(partition['allowed_lateness_ms'])})"
        )
    return notes


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _ms(value: int | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 120_000:
        return f"{value / 60_000:,.1f} min"
    return f"{value / 1000:,.1f} s"


def format_status(status: dict[str, Any]) -> str:
    """``pipeline_status`` as text for a terminal."""
    lag = status["lag"]
    lines = [
        f"pipeline {status['pipeline']} at {_when(status['at'])} UTC",
        f"  workers   {len(status['workers'])}: "
        + (", ".join(f"{w['id']} ({w['state']})" for w in status["workers"]) or "none alive"),
        f"  rates     in {status['rates']['in_per_s']:,.0f}/s, out "
        f"{status['rates']['out_per_s']:,.0f}/s",
        f"  lag       {lag['batches']:,} batches, {lag['measurements']:,} measurements, oldest "
        f"{_ms(lag['oldest_unconfirmed_age_ms'])}",
        f"  late      {status['late_measurements_while_listening']:,} measurements and "
        f"{status['dead_letters_while_listening']:,} dead letters in the "
        f"{status['listened_s']:g} s listened",
    ]
    if "degraded" in status:
        failed = status["functions"]["failed_batches"]
        why = ", ".join(f"{n:,} {reason}" for reason, n in sorted(failed.items())) or "none"
        lines.append(
            f"  functions {'DEGRADED' if status['degraded'] else 'ok'}; failed batches and "
            f"combiner calls (dead-lettered): {why}"
        )
    if status["clamped_measurements"]:
        lines.append(
            f"  clamped   {status['clamped_measurements']:,} measurements had timestamps beyond "
            "max_future_ms (on_future = clamp; the live workers' counts since they started)"
        )
    for p in status["partitions"]:
        closed = p["closed_through"]
        owner = f" (pool combiner {p['owner']})" if p.get("owner") else ""
        lines.append(
            f"  partition {p['partition']}{owner}: windows closed through "
            f"{'-' if closed is None else _when(closed)}; {p['why']} (max hold "
            f"{_ms(p['max_hold_ms'])}){partition_notes(p)}"
        )
    if not status["partitions"]:
        lines.append("  no combiner heartbeat yet: is the pipeline running?")
    lines.append(
        "  gateway            unconfirmed   behind (event time)  clock offset  holding  "
        "released  refused"
    )
    for g in status["gateways"]:
        holding = f"yes {_ms(g['holding_others_ms'])}" if g["holding"] else "no"
        unconfirmed = "-" if g["unconfirmed_batches"] is None else str(g["unconfirmed_batches"])
        lines.append(
            f"  {g['id']:<18} {unconfirmed:>11}"
            f"   {_ms(g['event_time_behind_ms']):>19}  {_ms(g['clock_offset_ms']):>12}  "
            f"{holding:<7}  {'yes' if g['released'] else 'no':<8}  {g['refused_batches']:>7}"
        )
    return "\n".join(lines)
