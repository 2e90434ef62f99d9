"""Markdown tables from a ``shoal bench matrix`` document (pure: data in, text out)."""

from __future__ import annotations

from typing import Any


def markdown(document: dict[str, Any]) -> str:
    """Every table of the matrix: targets, grid, ratios, highest sustained rates, encodings."""
    parts = [
        _machine(document),
        _targets(document.get("targets") or {}),
        _grid(document["cells"]),
        _ratios(document["cells"]),
        _searches(document.get("max_sustained") or {}),
        _encodings(document.get("encodings") or []),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ms(summary: dict[str, Any] | None) -> str:
    if not summary:
        return "-"
    return " / ".join(_n(summary[p], 1 if summary[p] < 100 else 0) for p in ("p50", "p95", "p99"))


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x"


def _machine(document: dict[str, Any]) -> str:
    m = document["machine"]
    plan = document["plan"]
    return (
        f"Run `{plan['name']}` on {m['cpu']}, {m['cores_logical']} cores, Python {m['python']}, "
        f"polars {m['polars']}; load average {m['load_1m']:.2f} when the encoding study ran; "
        f"{document['wall_s']:.0f} s in all."
    )


def _targets(targets: dict[str, Any]) -> str:
    rows = []
    throughput = targets.get("throughput_per_core")
    if throughput:
        rows.append(
            [
                "highest sustained rate per core used, 1 worker vs 1 Waitress thread",
                f"{_n(throughput['shoal_per_core'])} vs {_n(throughput['baseline_per_core'])} "
                f"meas/s per core (raw {_n(throughput['shoal_meas_per_s'])} vs "
                f"{_n(throughput['baseline_meas_per_s'])} meas/s)",
                _x(throughput["ratio"]),
                throughput["target"],
            ]
        )
    for key, what in (
        (
            "p99_publish_to_partial_at_A_4000",
            "p99 publish -> partials out (vs the baseline's t_rr)",
        ),
        ("p99_t_rr_at_A_4000", "p99 t_rr (shoal: publish -> applied)"),
    ):
        latency = targets.get(key)
        if latency:
            rows.append(
                [
                    f"{what}, scenario A, 25/s per sensor, batch 4,000",
                    f"{_n(latency['shoal_ms'], 1)} ms vs {_n(latency['baseline_ms'], 1)} ms",
                    _x(latency["ratio"]),
                    latency["target"],
                ]
            )
    if not rows:
        return ""
    return "### Targets\n\n" + _table(["what", "shoal vs baseline", "ratio", "target"], rows)


def _grid(cells: list[dict[str, Any]]) -> str:
    rows: list[list[str]] = []
    for cell in cells:
        runs = ([cell["baseline"]] if cell["baseline"] else []) + cell["shoal"]
        rows.extend(
            [
                cell["scenario"],
                f"{cell['rate_per_sensor']:g}",
                f"{cell['batch']:,}",
                "baseline" if run["system"] == "baseline" else f"shoal {run['variant']}",
                _n(run["offered_meas_per_s"]),
                _n(run["achieved_meas_per_s"]) + ("" if run["sustained"] else " (not sust.)"),
                _n(run["mean_batch_rows"]),
                _ms(run["t_ex_ms"]),
                _ms(run["t_rr_ms"]),
                _n(run["sut_cpu_percent"], 1),
                _n(run["sut_rss_mb"]),
                _n(run["bytes_per_meas"], 1),
                f"{run['loss_measurements']:,}",
            ]
            for run in runs
        )
    header = [
        "scen.",
        "rate/sensor",
        "batch",
        "system",
        "offered meas/s",
        "achieved meas/s",
        "rows/batch",
        "t_ex p50/p95/p99 ms",
        "t_rr p50/p95/p99 ms",
        "CPU % (SUT)",
        "RSS MB (SUT)",
        "B/meas",
        "loss",
    ]
    return "### The grid\n\n" + _table(header, rows)


def _ratios(cells: list[dict[str, Any]]) -> str:
    rows = []
    for cell in cells:
        for run in cell["shoal"]:
            r = run.get("vs_baseline")
            if not r:
                continue
            rows.append(
                [
                    f"{cell['scenario']} {cell['rate_per_sensor']:g}/s {cell['batch']:,}",
                    run["variant"],
                    _x(r["t_ex_p50"]),
                    _x(r["t_rr_p50"]),
                    _x(r["t_rr_p99"]),
                    _x(r["sut_cpu_percent"]),
                    _x(r["sut_rss_mb"]),
                    _x(r["bytes_per_meas"]),
                    _x(r["per_core_meas_per_s"]),
                ]
            )
    if not rows:
        return ""
    header = [
        "cell",
        "shoal variant",
        "t_ex p50",
        "t_rr p50",
        "t_rr p99",
        "CPU",
        "RSS",
        "B/meas",
        "meas/s per core",
    ]
    return "### shoal / baseline, per cell\n\n" + _table(header, rows)


def _searches(searches: dict[str, Any]) -> str:
    rows = []
    for search in searches.values():
        best = search.get("best") or {}
        rows.append(
            [
                search["label"],
                _n(search["max_sustained_meas_per_s"]),
                _n(best.get("sut_cpu_percent"), 1),
                _n(search["per_core_used"]),
                _ms(best.get("t_rr_ms")),
                " → ".join(
                    f"{s['rate_per_sensor']:g}{'✓' if s['sustained'] else '✗'}"
                    for s in search["steps"]
                ),
            ]
        )
    if not rows:
        return ""
    header = [
        "system",
        "highest sustained meas/s",
        "CPU % (SUT)",
        "meas/s per core used",
        "t_rr p50/p95/p99 ms",
        "steps (rate/sensor)",
    ]
    return "### Highest sustained rate\n\n" + _table(header, rows)


def _encodings(rows_in: list[dict[str, Any]]) -> str:
    rows = [
        [
            r["codec"],
            str(r["attributes"]),
            _n(r["bytes_per_meas"], 1),
            _n(r["gateway_cpu_s_per_million"], 3),
            _n(r["decode_cpu_s_per_million"], 3),
            _n(r["worker_cpu_s_per_million"], 3),
        ]
        for r in rows_in
    ]
    if not rows:
        return ""
    header = [
        "encoding",
        "attributes",
        "B/meas",
        "gateway CPU s / M meas",
        "decode CPU s / M",
        "worker CPU s / M",
    ]
    return "### Encodings\n\n" + _table(header, rows)
