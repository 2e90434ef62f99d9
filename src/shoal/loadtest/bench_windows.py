"""``shoal bench pipeline --window KIND``: the same pipeline, one window of another kind.

Every window kind must keep up with tumbling windows (docs/benchmarks.md, "Window kinds"), so
the benchmark runs a pipeline spec with its ``[[windows]]`` replaced by one preset window of
the kind asked for, everything else (key, aggregates, lateness, partitions) unchanged. The
variant is written as a TOML file next to the run, because child processes load their spec
from a file (``LocalPipelineConfig.spec_source``).

The presets suit the simulator's sensors (one measurement every 40 ms at 25/s, every sensor
of a gateway in every batch): each preset makes every row land in about one result, like
the 10-second tumbling window it is compared with.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import tomli_w

from shoal.errors import ConfigError

WINDOW_PRESETS: Final[Mapping[str, Mapping[str, Any]]] = {
    "tumbling": {"name": "tumbling-10s", "kind": "tumbling", "size_ms": 10_000},
    "hopping": {"name": "hopping-10s-1s", "kind": "hopping", "size_ms": 10_000, "slide_ms": 1_000},
    "sliding": {"name": "sliding-10s-1s", "kind": "sliding", "size_ms": 10_000, "step_ms": 1_000},
    # 250 rows: one window per sensor every 10 s at 25/s, as many results as tumbling-10s
    "count": {"name": "count-250", "kind": "count", "n": 250},
    # A sensor's session ends after three periods without a reading at 2.5/s (the rate of
    # the 100,000-key run; 30 periods at the default 25/s): gap 1.2 s. The simulator's
    # sensors never pause, so the 10 s grid of max_duration_ms cuts their sessions: one
    # result per sensor and 10 s, like tumbling.
    "session": {
        "name": "session-1200ms",
        "kind": "session",
        "gap_ms": 1_200,
        "max_duration_ms": 10_000,
    },
}
"""Window kind -> the ``[[windows]]`` table the benchmark swaps into the pipeline."""

SPEC_PRESETS: Final[Mapping[str, Mapping[str, Any]]] = {
    # A 10-s window stepping 1 s puts every row in ten windows, each with a result per key:
    # per-key retained results every 10 s of event time, as many as tumbling-10s publishes
    # (the window messages still go out every step). docs/benchmarks.md, "Sliding windows at
    # 100,000 keys: the per-key results".
    "hopping": {"key_results_every_ms": 10_000},
    "sliding": {"key_results_every_ms": 10_000},
}
"""Window kind -> pipeline settings the benchmark sets beside its window preset."""


def with_window(raw: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A pipeline spec mapping whose windows are the one preset window of ``kind``.

    With the kind's ``SPEC_PRESETS`` settings, which override the spec's own.
    """
    preset = WINDOW_PRESETS.get(kind)
    if preset is None:
        known = ", ".join(sorted(WINDOW_PRESETS))
        raise ConfigError(f"no benchmark window preset {kind!r}; known: {known}", field="window")
    return {**raw, **SPEC_PRESETS.get(kind, {}), "windows": [dict(preset)]}


def write_variant(spec_path: Path, kind: str, directory: Path) -> Path:
    """Write ``spec_path`` with its windows replaced by the ``kind`` preset; returns the file.

    Raises:
        ConfigError: ``kind`` has no preset.
    """
    raw = tomllib.loads(spec_path.read_text(encoding="utf-8"))
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{spec_path.stem}-{kind}.toml"
    out.write_text(tomli_w.dumps(with_window(raw, kind)), encoding="utf-8")
    return out
