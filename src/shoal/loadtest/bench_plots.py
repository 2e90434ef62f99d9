"""PNG figures from a ``shoal bench matrix`` document (matplotlib, Agg backend).

The research's figures, redrawn for shoal and the baseline: t_rr CDFs per batch size
(``trr-cdf.png``), CPU and memory against batch size (``cpu-memory.png``), achieved against
offered load (``throughput.png``), and the encoding study (``encodings.png``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from shoal.loadtest.baseline._extra import require

_COLOURS = {"baseline": "tab:red", "shoal": "tab:blue"}


def write_plots(document: dict[str, Any], directory: Path) -> list[Path]:
    """Draw every figure into ``directory``; returns the files written."""
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("trr-cdf.png", _trr_cdf),
        ("cpu-memory.png", _cpu_memory),
        ("throughput.png", _throughput),
        ("encodings.png", _encodings),
    ):
        figure = draw(plt, document)
        if figure is None:
            continue
        path = directory / name
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def _log_axis(axis: Any) -> None:
    """A log scale with plain numbers (5, 10, 20, ...) rather than powers of ten."""
    ticker = require("matplotlib.ticker")
    axis.axes.set_xscale("log")
    axis.set_major_formatter(
        ticker.FuncFormatter(lambda x, _pos: f"{x:,.0f}" if x >= 1 else f"{x:g}")
    )
    axis.set_minor_formatter(ticker.NullFormatter())


def _cdf_points(summary: dict[str, Any] | None) -> tuple[list[float], list[float]]:
    if not summary or not summary.get("cdf"):
        return [], []
    points = [(ms, q) for q, ms in summary["cdf"]] + [(summary["max"], 1.0)]
    return [p[0] for p in points], [p[1] for p in points]


def _main_runs(cell: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, run) of the baseline and shoal's first variant in a cell."""
    out = []
    if cell["baseline"]:
        out.append(("baseline (t_rr: request → reply)", cell["baseline"]))
    if cell["shoal"]:
        first = cell["shoal"][0]
        out.append((f"shoal {first['variant']} (seal → applied)", first))
    return out


def _trr_cdf(plt: Any, document: dict[str, Any]) -> Any:
    cells = document["cells"]
    if not cells:
        return None
    columns = min(len(cells), 4)
    rows = -(-len(cells) // columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False, sharey=True
    )
    for ax, cell in zip(axes.ravel(), cells, strict=False):
        for label, run in _main_runs(cell):
            xs, ys = _cdf_points(run["t_rr_ms"])
            if xs:
                ax.plot(xs, ys, marker=".", color=_COLOURS[run["system"]], label=label)
        _log_axis(ax.xaxis)
        ax.set_title(
            f"{cell['scenario']}, {cell['rate_per_sensor']:g}/s per sensor, "
            f"batch {cell['batch']:,}",
            fontsize=9,
        )
        ax.set_xlabel("t_rr (ms, log scale)")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(cells) :]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("fraction of batches")
    axes[0][0].legend(fontsize=7, loc="lower right")
    figure.suptitle("t_rr per batch: CDF")
    return figure


def _cpu_memory(plt: Any, document: dict[str, Any]) -> Any:
    series: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for cell in document["cells"]:
        group = f"{cell['scenario']} {cell['rate_per_sensor']:g}/s"
        for _, run in _main_runs(cell):
            series[(group, run["system"])].append(
                (cell["batch"], run["sut_cpu_percent"], run["sut_rss_mb"])
            )
    if not series:
        return None
    figure, (cpu_ax, rss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for (group, system), points in sorted(series.items()):
        points.sort()
        batches = [p[0] for p in points]
        marker = "o" if group.startswith("A") else "s"
        style = {"color": _COLOURS[system], "marker": marker, "label": f"{system}, {group}"}
        cpu_ax.plot(batches, [p[1] for p in points], **style)
        rss_ax.plot(batches, [p[2] for p in points], **style)
    for ax, label in ((cpu_ax, "CPU, % of one core"), (rss_ax, "peak RSS, MB")):
        _log_axis(ax.xaxis)
        ax.set_xlabel("batch size (measurements)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    cpu_ax.legend(fontsize=7)
    rss_ax.legend(fontsize=7)
    figure.suptitle("system under test (baseline: Waitress; shoal: broker + worker + combiner)")
    return figure


def _throughput(plt: Any, document: dict[str, Any]) -> Any:
    searches = document.get("max_sustained") or {}
    if not searches:
        return None
    figure, ax = plt.subplots(figsize=(7, 5))
    top = 0.0
    for key, search in searches.items():
        steps = sorted(search["steps"], key=lambda s: s["offered_meas_per_s"])
        xs = [s["offered_meas_per_s"] for s in steps]
        ys = [s["achieved_meas_per_s"] for s in steps]
        top = max(top, *xs, *ys)
        colour = _COLOURS["baseline" if key.startswith("baseline") else "shoal"]
        if not key.endswith("one"):  # the whole machine: a lighter shade, dashed
            colour = {"tab:red": "tab:orange", "tab:blue": "tab:cyan"}[colour]
        line = "-" if key.endswith("one") else "--"
        ax.plot(xs, ys, line, color=colour, marker="o", label=search["label"])
        for s in steps:
            if not s["sustained"]:
                ax.plot(s["offered_meas_per_s"], s["achieved_meas_per_s"], "x", color="black")
    ax.plot([1e4, top], [1e4, top], ":", color="grey", label="achieved = offered")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered measurements/s (log scale)")
    ax.set_ylabel("achieved measurements/s (log scale)")
    ax.set_title("throughput vs offered load (x: not sustained)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure


def _encodings(plt: Any, document: dict[str, Any]) -> Any:
    rows = document.get("encodings") or []
    if not rows:
        return None
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    counts = sorted({r["attributes"] for r in rows})
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    height = 0.8 / len(counts)
    metrics = (
        ("bytes_per_meas", "bytes per measurement"),
        ("gateway_cpu_s_per_million", "gateway CPU s per million (encode)"),
        ("worker_cpu_s_per_million", "worker CPU s per million (decode + work)"),
    )
    for ax, (metric, title) in zip(axes, metrics, strict=True):
        for i, count in enumerate(counts):
            values = {r["codec"]: r[metric] for r in rows if r["attributes"] == count}
            ys = [j + i * height for j in range(len(codecs))]
            ax.barh(ys, [values.get(c, 0.0) for c in codecs], height=height, label=f"{count} attr.")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks([j + height * (len(counts) - 1) / 2 for j in range(len(codecs))], codecs)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8)
    figure.suptitle("encoding study (batches of {:,} measurements)".format(rows[0]["rows"]))
    return figure
