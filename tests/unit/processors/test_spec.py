"""Pipeline specs: shipped and minimal specs parse; every invalid one is a ConfigError naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ConfigError, UsageError
from shoal.processors.spec import (
    MAX_WINDOWS_PER_ROW,
    AggregateSpec,
    PipelineSpec,
    WindowSpec,
    load_pipeline,
    parse_pipeline,
)
from shoal.schemas import DecodeLimits

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "processors").glob("*.toml"))

MINIMAL: dict[str, Any] = {"name": "p", "windows": [{"size_ms": 1_000}]}


def with_(**changes: Any) -> dict[str, Any]:
    return {**MINIMAL, **changes}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_specs_parse(path: Path) -> None:
    spec = load_pipeline(path)
    assert spec.source == path
    assert spec.windows
    assert spec.aggregates


def test_minimal_spec_defaults() -> None:
    spec = parse_pipeline(MINIMAL)
    assert spec == PipelineSpec(
        name="p",
        inputs=("ingest/+/+",),
        key="sensor_id",
        windows=(WindowSpec("tumbling-1s", "tumbling", 1_000, 1_000),),
        aggregates=(
            AggregateSpec("count"),
            AggregateSpec("mean"),
            AggregateSpec("min"),
            AggregateSpec("max"),
        ),
        lateness_ms=2_000,
        idle_timeout_ms=10_000,
        partitions=1,
        output_encodings=("json",),
        sketch_accuracy=0.01,
        checkpoint_interval_ms=1_000,
        limits=DecodeLimits(),
        source=None,
    )


def test_full_spec() -> None:
    spec = parse_pipeline(
        {
            "name": "site-7.temps",
            "inputs": ["ingest/+/temps", "ingest/gw-1/#"],
            "key": "unit",
            "windows": [
                {"kind": "tumbling", "size_ms": 60_000, "name": "minute"},
                {"kind": "hopping", "size_ms": 10_000, "slide_ms": 2_500},
                {"kind": "hopping", "size_ms": 1_500, "slide_ms": 1_500},
            ],
            "aggregates": ["Median", "avg", "std", "p99.9", "count", " last "],
            "lateness_ms": 0,
            "idle_timeout_ms": 100,
            "partitions": 64,
            "output_encodings": ["msgpack", "json"],
            "checkpoint_interval_ms": 50,
            "sketch": {"relative_accuracy": 0.001},
            "limits": {"max_rows": 10, "max_future_ms": False, "max_past_ms": 0},
        }
    )
    assert spec.inputs == ("ingest/+/temps", "ingest/gw-1/#")
    assert spec.key == "unit"
    assert spec.windows == (
        WindowSpec("minute", "tumbling", 60_000, 60_000),
        WindowSpec("hopping-10s-2500ms", "hopping", 10_000, 2_500),
        WindowSpec("hopping-1500ms-1500ms", "hopping", 1_500, 1_500),
    )
    assert spec.windows[1].windows_per_row == 4
    assert spec.aggregate_names == ("p50", "mean", "stddev", "p99.9", "count", "last")
    assert spec.quantiles == (0.5, pytest.approx(0.999))
    assert spec.window("minute").size_ms == 60_000
    with pytest.raises(UsageError, match="no window named 'nope'"):
        spec.window("nope")
    assert spec.output_encodings == ("msgpack", "json")
    assert spec.sketch_accuracy == 0.001
    assert spec.limits == DecodeLimits(max_rows=10, max_future_ms=None, max_past_ms=0)
    assert (spec.lateness_ms, spec.idle_timeout_ms, spec.partitions) == (0, 100, 64)


def test_far_future_rows_are_dead_lettered_unless_the_spec_says_clamp() -> None:
    assert parse_pipeline(MINIMAL).limits.on_future == "deadletter"
    clamping = parse_pipeline({**MINIMAL, "limits": {"on_future": "clamp"}})
    assert clamping.limits == DecodeLimits(on_future="clamp")
    explicit = parse_pipeline({**MINIMAL, "limits": {"on_future": "deadletter"}})
    assert explicit.limits == DecodeLimits()


@pytest.mark.parametrize(
    ("window", "name"),
    [
        ({"size_ms": 1_000}, "tumbling-1s"),
        ({"size_ms": 90_000}, "tumbling-90s"),
        ({"size_ms": 120_000}, "tumbling-2m"),
        ({"size_ms": 3_600_000}, "tumbling-1h"),
        ({"size_ms": 86_400_000}, "tumbling-1d"),
        ({"size_ms": 250}, "tumbling-250ms"),
        ({"kind": "hopping", "size_ms": 60_000, "slide_ms": 1_000}, "hopping-1m-1s"),
        ({"kind": "sliding", "size_ms": 10_000}, "sliding-10s-1s"),
        ({"kind": "sliding", "size_ms": 60_000, "step_ms": 5_000}, "sliding-1m-5s"),
    ],
)
def test_default_window_names(window: dict[str, Any], name: str) -> None:
    assert parse_pipeline(with_(windows=[window])).windows[0].name == name


@pytest.mark.parametrize(
    ("text", "name", "quantile"),
    [
        ("median", "p50", 0.5),
        ("MEDIAN", "p50", 0.5),
        ("p1", "p1", 0.01),
        ("p99", "p99", 0.99),
        ("p99.9", "p99.9", 0.999),
        ("p0.1", "p0.1", 0.001),
        ("avg", "mean", None),
        ("std", "stddev", None),
        ("Sum", "sum", None),
    ],
)
def test_aggregate_names_and_aliases(text: str, name: str, quantile: float | None) -> None:
    [aggregate] = parse_pipeline(with_(aggregates=[text])).aggregates
    assert aggregate.name == name
    assert aggregate.quantile == pytest.approx(quantile)


def test_load_pipeline_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        'name = "from-file"\naggregates = ["p95"]\n\n[[windows]]\nkind = "tumbling"\n'
        "size_ms = 5000\n"
    )
    spec = load_pipeline(path)
    assert spec.name == "from-file"
    assert spec.source == path
    assert spec.aggregate_names == ("p95",)


def test_load_pipeline_errors_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_pipeline(broken)
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_pipeline(tmp_path / "missing.toml")
    invalid = tmp_path / "invalid.toml"
    invalid.write_text('name = "x"\nlateness_ms = -1\n[[windows]]\nsize_ms = 10\n')
    with pytest.raises(ConfigError, match=r"invalid\.toml.*lateness_ms"):
        load_pipeline(invalid)


def hopping(size: int, slide: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "hopping", "size_ms": size, "slide_ms": slide, **extra}


INVALID: list[tuple[str, dict[str, Any], str]] = [
    # top level
    ("unknown key", with_(lateness=5), r"unknown setting\(s\) \['lateness'\]"),
    ("two unknown keys", with_(b=1, a=2), r"\['a', 'b'\]"),
    ("no name", {"windows": [{"size_ms": 1}]}, "name must be a string"),
    ("name not a string", with_(name=5), "name must be a string"),
    ("name with a slash", with_(name="a/b"), "name 'a/b' is not a valid name"),
    ("empty name", with_(name=""), "name '' is not a valid name"),
    ("bad key", with_(key="gateway_id"), "key must be one of"),
    # inputs
    ("inputs not a list", with_(inputs="ingest/+/+"), "inputs must be a non-empty list"),
    ("inputs empty", with_(inputs=[]), "inputs must be a non-empty list"),
    ("inputs not strings", with_(inputs=[1]), "inputs must be a non-empty list"),
    ("inputs partial plus", with_(inputs=["ingest/a+/x"]), "inputs: 'ingest/a\\+/x'"),
    ("inputs hash not last", with_(inputs=["ingest/#/x"]), "inputs: 'ingest/#/x'"),
    ("inputs partial hash", with_(inputs=["ingest/x#"]), "inputs: 'ingest/x#'"),
    ("inputs leading slash", with_(inputs=["/ingest"]), "inputs: '/ingest'"),
    ("inputs system topic", with_(inputs=["$SYS/#"]), "inputs: '\\$SYS/#'"),
    ("inputs empty filter", with_(inputs=[""]), "inputs: ''"),
    # windows
    ("no windows", {"name": "p"}, r"at least one \[\[windows\]\]"),
    ("empty windows", with_(windows=[]), r"at least one \[\[windows\]\]"),
    ("windows not tables", with_(windows=[1000]), r"windows must be an array of tables"),
    ("windows a table", with_(windows={"size_ms": 1}), r"windows must be an array of tables"),
    ("bad kind", with_(windows=[{"kind": "rolling", "size_ms": 1}]), r"windows\[0\].*kind"),
    (
        "hopping with step",
        with_(windows=[{"kind": "hopping", "size_ms": 1_000, "step_ms": 100}]),
        r"windows\[0\]: step_ms is only for sliding windows",
    ),
    (
        "sliding with slide",
        with_(windows=[{"kind": "sliding", "size_ms": 1_000, "slide_ms": 100}]),
        r"windows\[0\]: slide_ms is only for hopping windows",
    ),
    (
        "sliding without step, size not a multiple of ten",
        with_(windows=[{"kind": "sliding", "size_ms": 15}]),
        r"windows\[0\]: sliding windows need step_ms",
    ),
    (
        "sliding step too fine",
        with_(windows=[{"kind": "sliding", "size_ms": 1_000, "step_ms": 10}]),
        r"windows\[0\]: size_ms/step_ms = 100 windows per row; at most 64",
    ),
    ("no size", with_(windows=[{"kind": "tumbling"}]), r"windows\[0\]: size_ms is required"),
    ("zero size", with_(windows=[{"size_ms": 0}]), r"windows\[0\]: size_ms must be"),
    ("negative size", with_(windows=[{"size_ms": -5}]), r"windows\[0\]: size_ms must be"),
    ("size too big", with_(windows=[{"size_ms": 31 * 86_400_000 + 1}]), r"size_ms must be"),
    ("float size", with_(windows=[{"size_ms": 1000.0}]), r"windows\[0\]: size_ms must be"),
    ("bool size", with_(windows=[{"size_ms": True}]), r"windows\[0\]: size_ms must be"),
    (
        "tumbling with slide",
        with_(windows=[{"size_ms": 1_000, "slide_ms": 500}]),
        r"windows\[0\]: slide_ms is only for hopping windows",
    ),
    (
        "hopping without slide",
        with_(windows=[{"kind": "hopping", "size_ms": 1_000}]),
        r"windows\[0\]: hopping windows need slide_ms",
    ),
    (
        "slide larger than size",
        with_(windows=[hopping(1_000, 2_000)]),
        r"windows\[0\]: slide_ms must be an integer in \[1, 1000\]",
    ),
    (
        "size not a multiple of slide",
        with_(windows=[{"size_ms": 10}, hopping(1_000, 300)]),
        r"windows\[1\]: size_ms \(1000\) must be a multiple of slide_ms \(300\)",
    ),
    (
        "too many windows per row",
        with_(windows=[hopping(MAX_WINDOWS_PER_ROW * 100 + 100, 100)]),
        r"windows\[0\]: size_ms/slide_ms = 65 windows per row; at most 64",
    ),
    (
        "duplicate window names",
        with_(windows=[{"size_ms": 1_000}, {"size_ms": 2_000, "name": "tumbling-1s"}]),
        r"window names must be unique",
    ),
    (
        "duplicate default window names",
        with_(windows=[{"size_ms": 1_000}, {"size_ms": 1_000, "kind": "tumbling"}]),
        r"window names must be unique",
    ),
    ("bad window name", with_(windows=[{"size_ms": 1, "name": "a b"}]), r"windows\[0\]: name"),
    ("unknown window key", with_(windows=[{"size_ms": 1, "every": 2}]), r"windows\[0\].*every"),
    # aggregates
    ("unknown aggregate", with_(aggregates=["median2"]), r"unknown aggregate 'median2'"),
    ("p0", with_(aggregates=["p0"]), r"unknown aggregate 'p0'"),
    ("p100", with_(aggregates=["p100"]), r"unknown aggregate 'p100'"),
    ("p-1", with_(aggregates=["p-1"]), r"unknown aggregate 'p-1'"),
    ("p99.", with_(aggregates=["p99."]), r"unknown aggregate 'p99\.'"),
    ("empty aggregate", with_(aggregates=[""]), r"unknown aggregate ''"),
    ("aggregates empty", with_(aggregates=[]), r"aggregates must be a non-empty list"),
    ("aggregate not a string", with_(aggregates=[50]), r"aggregates must be a non-empty list"),
    ("duplicate aggregate", with_(aggregates=["min", "min"]), r"aggregate is listed twice"),
    ("median and p50", with_(aggregates=["median", "p50"]), r"aggregate is listed twice"),
    ("avg and mean", with_(aggregates=["avg", "mean"]), r"aggregate is listed twice"),
    ("std and stddev", with_(aggregates=["stddev", "std"]), r"aggregate is listed twice"),
    # encodings
    ("unknown encoding", with_(output_encodings=["xml"]), r"output_encodings: 'xml'"),
    ("encodings not a list", with_(output_encodings="json"), r"output_encodings must be"),
    # numbers
    ("lateness negative", with_(lateness_ms=-1), r"lateness_ms must be an integer in \[0, "),
    ("lateness too large", with_(lateness_ms=86_400_001), r"lateness_ms must be an integer"),
    ("lateness float", with_(lateness_ms=1.5), r"lateness_ms must be an integer"),
    ("lateness string", with_(lateness_ms="2s"), r"lateness_ms must be an integer"),
    ("lateness bool", with_(lateness_ms=True), r"lateness_ms must be an integer"),
    ("idle too short", with_(idle_timeout_ms=99), r"idle_timeout_ms must be an integer in \[100"),
    ("partitions zero", with_(partitions=0), r"partitions must be an integer in \[1, 64\]"),
    ("partitions too many", with_(partitions=65), r"partitions must be an integer in \[1, 64\]"),
    ("checkpoint too often", with_(checkpoint_interval_ms=49), r"checkpoint_interval_ms must be"),
    # sketch
    ("sketch not a table", with_(sketch=0.01), r"\[sketch\] must be a table"),
    (
        "accuracy too small",
        with_(sketch={"relative_accuracy": 1e-5}),
        r"\[sketch\]: relative_accuracy must be a number",
    ),
    (
        "accuracy too large",
        with_(sketch={"relative_accuracy": 0.5}),
        r"\[sketch\]: relative_accuracy must be a number",
    ),
    (
        "accuracy a string",
        with_(sketch={"relative_accuracy": "1%"}),
        r"\[sketch\]: relative_accuracy must be a number",
    ),
    ("unknown sketch key", with_(sketch={"kind": "dd"}), r"\[sketch\]: unknown setting\(s\)"),
    # limits
    ("limits not a table", with_(limits=[1]), r"\[limits\] must be a table"),
    ("limits unknown key", with_(limits={"max_bytes": 1}), r"\[limits\]: unknown.*max_bytes"),
    ("limits zero rows", with_(limits={"max_rows": 0}), r"\[limits\]: max_rows must be"),
    ("limits huge", with_(limits={"max_payload_bytes": 2**41}), r"max_payload_bytes must be"),
    (
        "limits negative future",
        with_(limits={"max_future_ms": -1}),
        r"\[limits\]: max_future_ms must be a non-negative integer or false",
    ),
    (
        "limits unknown future policy",
        with_(limits={"on_future": "drop"}),
        r"\[limits\]: on_future must be one of \['deadletter', 'clamp'\], not 'drop'",
    ),
    (
        "limits clamp without a future limit",
        with_(limits={"on_future": "clamp", "max_future_ms": False}),
        r"\[limits\]: on_future = 'clamp' needs max_future_ms",
    ),
    (
        "limits true past",
        with_(limits={"max_past_ms": True}),
        r"\[limits\]: max_past_ms must be a non-negative integer or false",
    ),
    (
        "limits float past",
        with_(limits={"max_past_ms": 1.0}),
        r"\[limits\]: max_past_ms must be a non-negative integer or false",
    ),
]


@pytest.mark.parametrize(("raw", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_specs_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(raw)


def test_errors_say_where(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^pipeline spec: "):
        parse_pipeline(with_(partitions=0))
    where = tmp_path / "site.toml"
    with pytest.raises(ConfigError, match=r"site\.toml: windows\[0\]"):
        parse_pipeline(with_(windows=[{"size_ms": 0}]), source=where)


def test_top_level_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match="expected a table"):
        parse_pipeline([])  # type: ignore[arg-type]


@pytest.mark.parametrize("per_row", [1, 2, MAX_WINDOWS_PER_ROW])
def test_windows_per_row_up_to_the_limit(per_row: int) -> None:
    spec = parse_pipeline(with_(windows=[hopping(100 * per_row, 100)]))
    assert spec.windows[0].windows_per_row == per_row


@pytest.mark.parametrize("value", [1e-4, 0.2])
def test_accuracy_bounds_are_inclusive(value: float) -> None:
    assert parse_pipeline(with_(sketch={"relative_accuracy": value})).sketch_accuracy == value


@pytest.mark.parametrize(("field", "low", "high"), [("lateness_ms", 0, 86_400_000)])
def test_lateness_bounds_are_inclusive(field: str, low: int, high: int) -> None:
    assert getattr(parse_pipeline(with_(**{field: low})), field) == low
    assert getattr(parse_pipeline(with_(**{field: high})), field) == high


def test_sliding_step_defaults_to_a_tenth_and_its_plan_carries_last_ts() -> None:
    spec = parse_pipeline(with_(windows=[{"kind": "sliding", "size_ms": 30_000}]))
    window = spec.windows[0]
    assert (window.kind, window.size_ms, window.slide_ms) == ("sliding", 30_000, 3_000)
    assert "last_ts" in spec.plan().field_names
    assert (
        "last_ts" not in parse_pipeline(with_(windows=[hopping(30_000, 3_000)])).plan().field_names
    )


def test_session_windows_read_gap_and_max_duration() -> None:
    spec = parse_pipeline(with_(windows=[{"kind": "session", "gap_ms": 30_000}]))
    window = spec.windows[0]
    assert (window.name, window.kind, window.gap_ms) == ("session-30s", "session", 30_000)
    assert window.max_duration_ms == 3_600_000  # the documented default
    assert (window.size_ms, window.slide_ms) == (30_000, 30_000)  # lateness: [first, first + gap)
    longer = with_(windows=[{"kind": "session", "gap_ms": 5_000, "max_duration_ms": 60_000}])
    assert parse_pipeline(longer).windows[0].max_duration_ms == 60_000


@pytest.mark.parametrize(
    ("window", "settings", "field", "message"),
    [
        ({"kind": "session"}, {}, "windows[0].gap_ms", "session windows need gap_ms"),
        ({"kind": "session", "gap_ms": 0}, {}, "windows[0].gap_ms", "gap_ms must be an integer"),
        (
            {"kind": "session", "gap_ms": 1_000, "size_ms": 1_000},
            {},
            "windows[0].size_ms",
            "size_ms is not for session windows",
        ),
        (
            {"kind": "session", "gap_ms": 10_000, "max_duration_ms": 5_000},
            {},
            "windows[0].max_duration_ms",
            "max_duration_ms must be an integer in",
        ),
    ],
)
def test_session_settings_are_checked(
    window: dict[str, Any], settings: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_pipeline(with_(windows=[window], **settings))
    assert caught.value.field == field


def _cadence_spec(every: int) -> Any:
    return parse_pipeline(
        {
            "name": "p",
            "windows": [
                {"kind": "tumbling", "size_ms": 10_000, "name": "t"},
                {"kind": "sliding", "size_ms": 10_000, "step_ms": 1_000, "name": "s1"},
                {"kind": "hopping", "size_ms": 9_000, "slide_ms": 3_000, "name": "h3"},
                {"kind": "session", "gap_ms": 1_000, "name": "v"},
            ],
            "key_results_every_ms": every,
        }
    )


def test_per_key_results_follow_their_cadence_by_window_end() -> None:
    """The first window ending at or after each multiple of key_results_every_ms publishes
    its per-key results; session windows (ends off any grid) always do; 0: every window."""
    spec = _cadence_spec(10_000)
    ends = range(1_000, 31_000, 1_000)
    due = {w: [e for e in ends if spec.key_results_due(w, e)] for w in ("t", "s1", "v")}
    assert due["s1"] == [10_000, 20_000, 30_000]
    assert due["v"] == list(ends)
    assert [e for e in range(10_000, 40_000, 10_000) if spec.key_results_due("t", e)] == [
        10_000,
        20_000,
        30_000,
    ]
    # a step that misses the multiples: the first end after each (12 s after 10, 21 after 20)
    assert [e for e in range(3_000, 31_000, 3_000) if spec.key_results_due("h3", e)] == [
        12_000,
        21_000,
        30_000,
    ]
    assert all(_cadence_spec(0).key_results_due("s1", e) for e in ends)


def test_a_negative_key_results_cadence_is_refused() -> None:
    with pytest.raises(ConfigError, match="key_results_every_ms"):
        _cadence_spec(-1)
