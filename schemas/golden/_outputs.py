"""The golden output messages: fixed input run through the code that builds each message.

``output_cases()`` drives a worker's and a combiner's pure parts on a fake clock (decode, the
partial builder, the combiner core) and renders what they would publish with the same
functions the runtime calls (``shoal.processors.results``, ``Confirm.to_json``,
``Partial.encode``, the runtime's ``metrics()``). ``generate_outputs.py`` writes the result;
``tests/unit/schemas/test_output_contract.py`` runs it again and compares, so a change to a
message that does not change its golden file (and its schema) fails a test.

The scenario (one gateway ``gw-01`` on stream ``plant``, pipeline ``temps``, 10 s tumbling
windows, 1 s lateness):

* seq 0 and 1 fill the window [T0, T0 + 10 s) and move the watermark past its close;
* seq 2 brings a row for that window, behind gw-01's own watermark: late, ``behind_watermark``;
* seq 3 is refused (a string where a value belongs): a dead letter and a rejected partial;
* gw-02 appears after the window closed, with a row for it: late, ``window_closed``;
* a second pipeline ``by-unit`` keys by ``unit``, so one key is null (topic segment ``_``);
* the control plane's registry (``shoal.control.registry``) deploys ``temps`` from TOML,
  refuses an invalid spec and an unreadable request, and deletes ``temps``: its requests,
  results and retained documents;
* the same data through ``temps`` with ``allowed_lateness_ms`` (``TEMPS_CORRECTED``): seq 2's
  row is within the allowance, folds into the closed window and makes a correction
  (revision 2);
* the same first two batches through ``counts`` (``COUNTS``: count windows of 2 rows per key):
  the partial carries rows, and t1's first window (rows at T0 and T0 + 250 ms) closes once
  the threshold passes them; a flush then emits the unfinished windows;
* a pipeline ``visits`` with 5 s session windows: two sensors' sessions start at T0 and end
  apart, so one message (per start) carries each key's own ``end``; with allowed lateness, a
  late row of t2 before T0 moves t2's session to an earlier start: the T0 message comes again
  (revision 2) with t2's retraction (``rows`` 0, ``superseded_by``).

Only the heartbeats' process-dependent figures (uptime, CPU, rates over wall time) are set
to fixed values after ``metrics()`` returns; every other byte is the code's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

import orjson
import polars as pl

from shoal.broker.settings import BrokerSettings
from shoal.clock import FakeClock
from shoal.control.assignment import Announcement, Owned
from shoal.control.messages import Request
from shoal.control.registry import Registry, refuse_unreadable
from shoal.errors import ControlError, InputError, StateCapError
from shoal.processors.combine import COUNT_CLOSE_INTERVAL_MS, Combiner, LateRows
from shoal.processors.partials import BatchInfo, Partial, PartialBuilder
from shoal.processors.result_parts import json_body_size, msgpack_body_size, split_result
from shoal.processors.results import (
    Emission,
    key_messages,
    late_message,
    split_windows,
    window_json,
    window_msgpack,
)
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.state import ClosedWindows
from shoal.rules import alert_payload
from shoal.runtime.combiner import CombinerConfig, CombinerRuntime
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding, decode_batch, encode_batch, peek_envelope
from shoal.schemas.control import Confirm, GatewayStatus
from shoal.schemas.deadletter import DEADLETTER_HEADROOM, deadletter_message
from shoal.schemas.topics import Topics

T0: Final = 1_700_000_000_000
STREAM: Final = "plant"
WORKER_ID: Final = "shoal-worker-temps-edge1-4242-1-9f3a"
CLIENT_ID: Final = "shoal-pipeline-laptop-5150-1-07c2"
"""A ``shoal pipeline`` client, as ``unique_client_id`` names it."""
TOPICS: Final = Topics()

TEMPS: Final = parse_pipeline(
    {
        "name": "temps",
        "windows": [{"kind": "tumbling", "size_ms": 10_000}],
        # Spelled out: the golden messages stay as committed when the registry grows.
        "aggregates": [
            *("count", "sum", "mean", "min", "max", "stddev", "first", "last"),
            *("p50", "p99"),
        ],
        "lateness_ms": 1_000,
        "output_encodings": ["json", "msgpack"],
    }
)
TEMPS_CORRECTED: Final = replace(TEMPS, allowed_lateness_ms=60_000)
"""``temps`` folding rows up to a minute later still into closed windows (corrections)."""
VISITS: Final = parse_pipeline(
    {
        "name": "visits",
        "windows": [{"kind": "session", "gap_ms": 5_000}],
        "aggregates": ["count", "mean"],
        "lateness_ms": 1_000,
        "output_encodings": ["json", "msgpack"],
    }
)
BY_UNIT: Final = parse_pipeline(
    {
        "name": "by-unit",
        "key": "unit",
        "windows": [{"kind": "tumbling", "size_ms": 60_000}],
        "aggregates": ["count", "mean"],
    }
)
COUNTS: Final = parse_pipeline(
    {
        "name": "counts",
        "windows": [{"kind": "count", "n": 2}],
        "aggregates": ["count", "mean", "min", "max", "first", "last", "p50"],
        "lateness_ms": 1_000,
        "output_encodings": ["json", "msgpack"],
    }
)
"""Count windows: every 2 rows of a key in event order."""
HOT: Final = parse_pipeline(
    {
        "name": "hot",
        "windows": [{"kind": "tumbling", "size_ms": 10_000}],
        "aggregates": ["count", "mean", "max"],
        "lateness_ms": 1_000,
        "alerts": [{"name": "too-warm", "condition": "mean > 21", "resolve": "mean < 15"}],
    }
)
"""An alert per sensor: firing when a window's mean is above 21, resolved below 15."""
MISMATCH: Final = InputError(
    "the batch names another gateway than its topic",
    reason="gateway_mismatch",
    field="gateway_id",
    expected="gw-01",
    found="gw-99",
)
"""The error ``Worker._decode`` raises for a batch whose envelope names another gateway."""


NOTES: Final = {
    "partial": "internal: the state rows and sketch of one batch for one partition",
    "result-window": "a closed window, every key of the partition (JSON, the first encoding)",
    "result-window-columnar": "the same window in MsgPack, one array per column",
    "result-key": "the latest result of one key (retained)",
    "deadletter": "a batch refused for one bad row: its gateway and seq were readable",
    "partial-rejected": "internal: a refused batch marked handled, with no rows",
    "late": "rows of one batch behind their gateway's own watermark",
    "late-window-closed": "rows of one batch for a window already emitted",
    "deadletter-unreadable": "bytes that are no batch at all: no field, no row, no seq to mark",
    "deadletter-truncated": "a record cut to the broker's packet limit (payload_truncated)",
    "deadletter-state-cap": "a partial a combiner refused at its state cap (max_state_cells)",
    "result-window-versioned": "a window of a pipeline deployed at run time: its spec version",
    "result-window-null-key": "a pipeline keyed by an attribute: rows without it have key null",
    "result-key-null-key": "the latest result of the null key, on the topic segment _",
    "result-window-correction": "a window re-published with a late row folded in (revision 2)",
    "result-window-columnar-correction": "the same correction in MsgPack",
    "result-key-correction": "the corrected latest result of one key (retained)",
    "result-window-part": "part 0 of a window split in 2 to fit the broker's packet limit",
    "result-window-columnar-part": "part 1 of the same window, split in MsgPack",
    "result-window-session": "sessions of two keys that start together; each has its end",
    "result-window-columnar-session": "the same sessions in MsgPack: end is a column",
    "result-key-session": "the latest session of one key (retained): its own end",
    "result-window-session-correction": (
        "a late row moved t2's session to an earlier start: the T0 message again (revision 2)"
        " with t2 retracted (rows 0, superseded_by)"
    ),
    "result-window-columnar-session-correction": "the same correction in MsgPack",
    "confirm": "every batch of gw-01 up to seq 3 is applied and durable in partition 0",
    "confirm-missing": "with seqs the partition has waited for while holding later ones",
    "gateway-status": "a gateway's retained status",
    "control-flush": "close every open window now (shoal up, benchmarks, operators)",
    "control-flush-confirmed": (
        "shoal pipeline flush: the same, each partition to confirm on the asker's control topic"
    ),
    "control-flushed": "partition 1 confirms: its 3 flushed windows are at the broker",
    "control-drain": "a worker leaves without losing a batch",
    "control-reset-stats": "benchmarks: forget warm-up latencies",
    "control-marker": "a draining worker's marker to itself (Worker._drain_when_asked)",
    "metrics-combiner": "a combiner partition's heartbeat (every heartbeat_ms, QoS 0)",
    "metrics-worker": "a worker's heartbeat (every heartbeat_ms, QoS 0)",
    "alert-firing": "an alert firing for one key at the window that met its condition",
    "alert-resolved": "the same alert resolved at a later window (retained, replaces it)",
    "metrics-worker-gone": "a worker's will: the broker publishes it when the worker vanishes",
    "pipeline-request": "shoal pipeline deploy: the spec as TOML text",
    "pipeline-request-delete": "shoal pipeline delete: a name",
    "pipeline-result": "accepted: temps deployed as version 1, with its content hash",
    "pipeline-result-refused": "refused: an invalid spec, with the reason and the field path",
    "pipeline-result-unreadable": "refused: a request that is not JSON (no id to carry back)",
    "pipeline-document": "the retained registry entry of temps: version, hash, canonical spec",
    "pipeline-document-deleted": "after delete: a tombstone keeps the version number",
    "combiner-announcement": (
        "a pool combiner owning both partitions of temps at version 2, one still finishing v1"
    ),
    "partial-count": "internal: count windows ship a batch's rows (events), not state",
    "result-window-count": "count windows completed in one close step: index, first/last ts",
    "result-window-columnar-count": "the same count windows in MsgPack",
    "result-key-count": "the latest count window of one key (retained)",
    "result-window-count-flush": "a flush: unfinished count windows leave with rows < n",
}
"""Every golden case by name, with what it shows (``manifest.json``'s notes)."""


@dataclass(frozen=True, slots=True)
class OutputCase:
    """One golden message and how it travels.

    Attributes:
        name: file name without extension, below ``golden/outputs/``.
        kind: its ``shoal.schemas.catalog`` kind.
        topic: the topic it is published on (no deployment root).
        payload: the exact bytes.
        syntax: ``json`` or ``msgpack`` (MsgPack goldens get a ``.expected.json`` view).
        note: what it shows.
    """

    name: str
    kind: str
    topic: str
    payload: bytes
    syntax: str
    note: str

    @property
    def file(self) -> str:
        """The payload's path below ``golden/``."""
        return f"outputs/{self.name}.{'json' if self.syntax == 'json' else 'msgpack'}"


@dataclass
class _Scenario:
    """The running scenario: one builder (the worker), the combiner core, the clock."""

    clock: FakeClock = field(default_factory=lambda: FakeClock(T0 + 20_000))
    cases: list[OutputCase] = field(default_factory=list)
    late: list[LateRows] = field(default_factory=list)

    def add(self, name: str, kind: str, topic: str, payload: bytes) -> None:
        syntax = "json" if payload[:1] == b"{" else "msgpack"
        self.cases.append(OutputCase(name, kind, topic, payload, syntax, NOTES[name]))


def _batch(gateway_id: str, seq: int, rows: list[tuple[str, int, float, str | None]]) -> bytes:
    frame = pl.DataFrame(
        {
            "sensor_id": [r[0] for r in rows],
            "ts": [T0 + r[1] for r in rows],
            "value": [r[2] for r in rows],
            "unit": [r[3] for r in rows],
        },
        schema={"sensor_id": pl.String, "ts": pl.Int64, "value": pl.Float64, "unit": pl.String},
    )
    return encode_batch(
        frame,
        gateway_id=gateway_id,
        seq=seq,
        sent_at_ms=T0 + 19_000,
        encoding=Encoding.JSON_ROWS,
    )


def _first_window() -> tuple[bytes, bytes]:
    """Seq 0 and 1 of gw-01: they fill [T0, T0 + 10 s) and move its watermark past the close."""
    seq0 = _batch(
        "gw-01", 0, [("t1", 0, 21.5, "°C"), ("t1", 250, 21.625, "°C"), ("t2", 500, 3.0, None)]
    )
    seq1 = _batch("gw-01", 1, [("t1", 12_000, 22.0, "°C"), ("t2", 12_500, 4.5, None)])
    return seq0, seq1


def _status(gateway_id: str, next_seq: int, at_ms: int) -> GatewayStatus:
    return GatewayStatus(gateway_id, STREAM, next_seq, 0, next_seq, 6, T0 + 19_000, 900, 6, at_ms)


def _work(
    s: _Scenario, spec: PipelineSpec, builder: PartialBuilder, gateway_id: str, payload: bytes
) -> tuple[list[Partial], bytes | None]:
    """What ``Worker._handle`` publishes for one batch: partials, and a dead letter if refused."""
    now = s.clock.now_ms()
    try:
        batch = decode_batch(payload, limits=spec.limits, now_ms=now)
    except InputError as exc:
        record = deadletter_message(
            pipeline=spec.name,
            topic=TOPICS.ingest(STREAM, gateway_id),
            content_type=None,
            payload=payload,
            error=exc.as_record(),
            worker=builder.worker_id,
            at_ms=now,
        )
        named = peek_envelope(payload, spec.limits)
        if named is None:
            return [], record
        info = BatchInfo(*named, STREAM, 0, None, None, 0, now, builder.worker_id)
        return builder.rejected(replace(info, status="rejected", reason=exc.reason), now), record
    env = batch.envelope
    info = BatchInfo(
        gateway_id, env.seq, STREAM, batch.rows, None, None, env.sent_at_ms, now, builder.worker_id
    )
    return builder.build_batch(batch, info, now), None


def _combine(s: _Scenario, core: Combiner, partials: list[Partial]) -> list[ClosedWindows]:
    """Apply partials (through their wire form) as ``CombinerRuntime`` does; closed windows."""
    closed: list[ClosedWindows] = []
    for partial in partials:
        step = core.receive(Partial.decode(partial.encode()))
        s.late.extend(step.late)
        found = (step.closed, core.close_ready(s.clock.now_ms()))
        closed.extend(c for c in found if c is not None and not c.empty)
    return closed


def _emit(  # noqa: PLR0917 - private; one call per pipeline of the scenario
    s: _Scenario,
    spec: PipelineSpec,
    core: Combiner,
    closed: list[ClosedWindows],
    tag: str = "",
    key: str | None = "t1",
) -> None:
    """Window messages of ``closed`` as ``CombinerRuntime._emit`` renders them; ``key``'s."""
    ctx = Emission(spec.name, 0, spec.partitions, core.closed_through, s.clock.now_ms())
    for frame in closed:
        for result in split_windows(frame.frame, frame.revisions, frame.sessions):
            rendered = {"result-window": window_json(result, ctx)}
            if "msgpack" in spec.output_encodings:
                rendered["result-window-columnar"] = window_msgpack(result, ctx)
            for kind, payload in rendered.items():
                topic = TOPICS.results(spec.name)
                if kind != "result-window":
                    topic = TOPICS.results_encoded(spec.name, "msgpack")
                s.add(kind + tag, kind, topic, payload)
            keys = dict(key_messages(result, spec.name, s.clock.now_ms()))
            topic = TOPICS.result_key(spec.name, key)
            s.add("result-key" + tag, "result-key", topic, keys[key])


def _temps(s: _Scenario) -> CombinerRuntime:
    spec = TEMPS
    builder = PartialBuilder(spec, WORKER_ID)
    # memory not known: the state cap the heartbeat states is the fixed default, whatever
    # machine the goldens are generated on
    config = CombinerConfig(spec, 0, BrokerSettings(), memory_bytes=None)
    runtime = CombinerRuntime(config, s.clock)
    core = runtime.core
    core.receive_status(_status("gw-01", 4, s.clock.now_ms()))
    seq0, seq1 = _first_window()
    seq2 = _batch("gw-01", 2, [("t2", 100, 4.0, None)])
    seq3 = seq2.replace(b'"seq":2', b'"seq":3').replace(b'"value":4.0', b'"value":"warm"')
    partials, _ = _work(s, spec, builder, "gw-01", seq0)
    s.add("partial", "partial", TOPICS.partials(spec.name, 0), partials[0].encode())
    closed = _combine(s, core, partials)
    s.clock.advance(100)
    closed += _combine(s, core, _work(s, spec, builder, "gw-01", seq1)[0])
    _emit(s, spec, core, closed)
    # A pipeline deployed at run time: the message names the spec version that computed it.
    versioned = Emission(spec.name, 0, spec.partitions, core.closed_through, s.clock.now_ms(), 2)
    first = split_windows(closed[0].frame, closed[0].revisions, closed[0].sessions)[0]
    topic = TOPICS.results(spec.name)
    s.add("result-window-versioned", "result-window", topic, window_json(first, versioned))
    s.clock.advance(100)
    _combine(s, core, _work(s, spec, builder, "gw-01", seq2)[0])
    s.clock.advance(100)
    rejected, dead = _work(s, spec, builder, "gw-01", seq3)
    assert dead is not None
    s.add("deadletter", "deadletter", TOPICS.deadletter(spec.name), dead)
    s.add("partial-rejected", "partial", TOPICS.partials(spec.name, 0), rejected[0].encode())
    _combine(s, core, rejected)
    s.clock.advance(100)
    core.receive_status(_status("gw-02", 1, s.clock.now_ms()))
    returning = _batch("gw-02", 0, [("t3", 9_000, 7.25, None)])  # for the closed window
    _combine(s, core, _work(s, spec, builder, "gw-02", returning)[0])
    for late, name in zip(s.late, ("late", "late-window-closed"), strict=True):
        payload = late_message(late, spec.name, 0, s.clock.now_ms())
        s.add(name, "late", TOPICS.late(spec.name), payload)
    return runtime


def _corrections(s: _Scenario) -> None:
    """Batches 0-2 of ``_temps`` with allowed lateness: the late row of seq 2 makes a correction."""
    spec = TEMPS_CORRECTED
    builder = PartialBuilder(spec, WORKER_ID)
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 3, s.clock.now_ms()))
    seq2 = _batch("gw-01", 2, [("t2", 100, 4.0, None), ("t1", 9_900, 21.75, "°C")])
    for payload in _first_window():
        _combine(s, core, _work(s, spec, builder, "gw-01", payload)[0])
    s.clock.advance(100)
    corrected = _combine(s, core, _work(s, spec, builder, "gw-01", seq2)[0])
    assert [c.revisions for c in corrected] == [{("tumbling-10s", T0): 2}]
    _emit(s, spec, core, corrected, "-correction")


def _counts(s: _Scenario) -> None:
    """Seq 0 and 1 of gw-01 through count windows of 2 rows; then a flush."""
    spec = COUNTS
    builder = PartialBuilder(spec, WORKER_ID)
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 2, s.clock.now_ms()))
    seq0, seq1 = _first_window()
    partials, _ = _work(s, spec, builder, "gw-01", seq0)
    s.add("partial-count", "partial", TOPICS.partials(spec.name, 0), partials[0].encode())
    closed = _combine(s, core, partials)
    # count windows close at most once per COUNT_CLOSE_INTERVAL_MS of the clock (the runtime's
    # tick keeps asking): seq 1 comes after one interval, so its rows close the windows
    s.clock.advance(COUNT_CLOSE_INTERVAL_MS)
    closed += _combine(s, core, _work(s, spec, builder, "gw-01", seq1)[0])
    _emit(s, spec, core, closed, "-count")
    s.clock.advance(100)
    flushed = core.flush()
    ctx = Emission(spec.name, 0, spec.partitions, core.closed_through, s.clock.now_ms())
    (result,) = split_windows(flushed.frame)
    s.add(
        "result-window-count-flush",
        "result-window",
        TOPICS.results(spec.name),
        window_json(result, ctx),
    )


def _sessions(s: _Scenario) -> None:
    """Sessions of t1 (0-3 s) and t2 (0-2 s), closed by a row 30 s on."""
    spec = VISITS
    builder = PartialBuilder(spec, WORKER_ID)
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 2, s.clock.now_ms()))
    rows = [("t1", 0, 1.0, None), ("t1", 1_000, 2.0, None), ("t2", 0, 5.0, None)]
    seq0 = _batch("gw-01", 0, [*rows, ("t1", 3_000, 4.0, None), ("t2", 2_000, 7.0, None)])
    seq1 = _batch("gw-01", 1, [("t1", 30_000, 3.0, None)])
    closed = _combine(s, core, _work(s, spec, builder, "gw-01", seq0)[0])
    s.clock.advance(100)
    closed += _combine(s, core, _work(s, spec, builder, "gw-01", seq1)[0])
    assert [c.frame.height for c in closed] == [2]
    _emit(s, spec, core, closed, "-session")


def _session_corrections(s: _Scenario) -> None:
    """``_sessions`` with allowed lateness; then t2 at T0 - 1.5 s joins t2's session."""
    spec = replace(VISITS, allowed_lateness_ms=60_000)
    builder = PartialBuilder(spec, WORKER_ID)
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 3, s.clock.now_ms()))
    rows = [("t1", 0, 1.0, None), ("t1", 1_000, 2.0, None), ("t2", 0, 5.0, None)]
    seq0 = _batch("gw-01", 0, [*rows, ("t1", 3_000, 4.0, None), ("t2", 2_000, 7.0, None)])
    seq1 = _batch("gw-01", 1, [("t1", 30_000, 3.0, None)])
    seq2 = _batch("gw-01", 2, [("t2", -1_500, 6.0, None)])
    for payload in (seq0, seq1):
        _combine(s, core, _work(s, spec, builder, "gw-01", payload)[0])
        s.clock.advance(100)
    corrected = _combine(s, core, _work(s, spec, builder, "gw-01", seq2)[0])
    assert [c.revisions for c in corrected] == [{("session-5s", T0): 2}]
    ctx = Emission(spec.name, 0, spec.partitions, core.closed_through, s.clock.now_ms())
    [result] = [
        r
        for c in corrected
        for r in split_windows(c.frame, c.revisions, c.sessions)
        if r.start == T0
    ]
    topic = TOPICS.results(spec.name)
    s.add("result-window-session-correction", "result-window", topic, window_json(result, ctx))
    s.add(
        "result-window-columnar-session-correction",
        "result-window-columnar",
        TOPICS.results_encoded(spec.name, "msgpack"),
        window_msgpack(result, ctx),
    )


def _alerts(s: _Scenario) -> None:
    """Seq 0 and 1 of gw-01 through ``hot``: t1 fires at T0; seq 2 (t1 at 10.0) resolves it."""
    spec = HOT
    builder = PartialBuilder(spec, WORKER_ID)
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 3, s.clock.now_ms()))
    seq0, seq1 = _first_window()
    seq2 = _batch("gw-01", 2, [("t1", 22_000, 10.0, "°C")])
    for payload in (seq0, seq1, seq2):
        _combine(s, core, _work(s, spec, builder, "gw-01", payload)[0])
        s.clock.advance(100)
    core.flush()
    fired, resolved = core.take_transitions()
    by_name = {a.name: a for a in spec.alerts}
    for name, transition in (("alert-firing", fired), ("alert-resolved", resolved)):
        payload = alert_payload(
            transition,
            by_name[transition.alert],
            pipeline=spec.name,
            partition=0,
            spec=core.fingerprint,
            at_ms=s.clock.now_ms(),
        )
        s.add(name, "alert", TOPICS.alert(spec.name, transition.alert, transition.key), payload)


def _deadletters(s: _Scenario) -> None:
    builder = PartialBuilder(TEMPS, WORKER_ID)
    _, dead = _work(s, TEMPS, builder, "gw-01", b"\x00garbage")
    assert dead is not None
    s.add("deadletter-unreadable", "deadletter", TOPICS.deadletter(TEMPS.name), dead)
    big = _batch("gw-01", 9, [("t1", 1_000 + i, 1.0, None) for i in range(40)])
    record = deadletter_message(
        pipeline=TEMPS.name,
        topic=TOPICS.ingest(STREAM, "gw-01"),
        content_type=Encoding.JSON_ROWS.content_type,
        payload=big,
        error=MISMATCH.as_record(),
        worker=WORKER_ID,
        at_ms=s.clock.now_ms(),
        max_bytes=DEADLETTER_HEADROOM // 4,
    )
    s.add("deadletter-truncated", "deadletter", TOPICS.deadletter(TEMPS.name), record)
    # A combiner at its cap: the partial as the worker published it, refused whole.
    [partial], _ = _work(s, TEMPS, builder, "gw-01", _batch("gw-01", 10, [("t9", 1, 2.0, None)]))
    capped = StateCapError(gateway_id="gw-01", seq=10, cells=3_999_999, incoming=2, cap=4_000_000)
    record = deadletter_message(
        pipeline=TEMPS.name,
        topic=TOPICS.partials(TEMPS.name, 0),
        content_type=None,
        payload=partial.encode(),
        error=capped.as_record(),
        worker=f"shoal-combiner-{TEMPS.name}-0",
        at_ms=s.clock.now_ms(),
    )
    s.add("deadletter-state-cap", "deadletter", TOPICS.deadletter(TEMPS.name), record)


def _parts(s: _Scenario) -> None:
    """The first window of ``_temps``, split as a combiner splits it for a small packet limit."""
    spec = TEMPS
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 2, s.clock.now_ms()))
    builder = PartialBuilder(spec, WORKER_ID)
    for payload in _first_window():
        _combine(s, core, _work(s, spec, builder, "gw-01", payload)[0])
    (result,) = split_windows(core.flush().frame)
    ctx = Emission(spec.name, 0, spec.partitions, core.closed_through, s.clock.now_ms())
    topic = TOPICS.results(spec.name)
    budget = json_body_size(result.frame) - 1  # one byte short: two parts of one key
    json_parts = split_result(result, budget).parts
    s.add("result-window-part", "result-window", topic, window_json(json_parts[0], ctx))
    budget = msgpack_body_size(result.frame) - 1
    packed = split_result(result, budget, msgpack_body_size).parts
    topic = TOPICS.results_encoded(spec.name, "msgpack")
    kind = "result-window-columnar"
    s.add("result-window-columnar-part", kind, topic, window_msgpack(packed[1], ctx))


def _by_unit(s: _Scenario) -> None:
    spec = BY_UNIT
    core = Combiner(spec, 0, s.clock)
    core.receive_status(_status("gw-01", 1, s.clock.now_ms()))
    payload = _batch("gw-01", 0, [("t1", 1_000, 21.5, "°C"), ("d1", 2_000, 1.0, None)])
    _combine(s, core, _work(s, spec, PartialBuilder(spec, WORKER_ID), "gw-01", payload)[0])
    _emit(s, spec, core, [core.flush()], "-null-key", key=None)


def _control(s: _Scenario) -> None:
    spec = TEMPS
    s.add(
        "confirm",
        "confirm",
        TOPICS.confirm("gw-01", spec.name, 0),
        Confirm("gw-01", spec.name, 0, spec.partitions, 3, s.clock.now_ms()).to_json(),
    )
    s.add(
        "confirm-missing",
        "confirm",
        TOPICS.confirm("gw-01", spec.name, 0),
        Confirm("gw-01", spec.name, 0, 4, 3, s.clock.now_ms(), (5, 6)).to_json(),
    )
    s.add(
        "gateway-status",
        "gateway-status",
        TOPICS.gateway_status("gw-01"),
        _status("gw-01", 4, s.clock.now_ms()).to_json(),
    )
    for name, command in (
        ("control-flush", {"cmd": "flush"}),
        ("control-drain", {"cmd": "drain"}),
        ("control-reset-stats", {"cmd": "reset_stats"}),
        ("control-marker", {"cmd": "marker", "token": "5f0c2a9e7d41b386"}),
    ):
        topic = (
            TOPICS.combiner_control(spec.name)
            if command["cmd"] in ("flush", "reset_stats")
            else TOPICS.control(WORKER_ID)
        )
        s.add(name, "control", topic, orjson.dumps(command))
    asker = "shoal-pipeline-3f9a1c2e"
    request = {"cmd": "flush", "id": "9c1d0e7a5b3f2468", "reply": asker}
    s.add(
        "control-flush-confirmed",
        "control",
        TOPICS.combiner_control(spec.name),
        orjson.dumps(request),
    )
    pooled = replace(spec, partitions=2)
    config = CombinerConfig(pooled, 1, BrokerSettings(), owner="c0", version=2, memory_bytes=None)
    reply = CombinerRuntime(config, s.clock).flush_confirmation(request["id"], 3)
    s.add("control-flushed", "control", TOPICS.control(asker), reply)


_COMBINER_FIXED: Final = {"uptime_s": 42.125}
_WORKER_FIXED: Final = {
    "uptime_s": 42.5,
    "busy_s": 0.012345,
    "busy_fraction": 0.0003,
    "cpu_percent": 1.5,
    "batches_per_s": 0.1,
    "rows_per_s": 0.4,
    "capacity_rows_per_s": 2700.0,
}
"""Figures that depend on the process (wall time, CPU), fixed so the goldens are stable."""


def _metrics(s: _Scenario, runtime: CombinerRuntime) -> None:
    for ms in (3.5, 4.0, 12.25):
        runtime.apply_latency.add(ms)
    runtime.result_latency.add(2.75)
    body = runtime.metrics()
    assert set(_COMBINER_FIXED) <= set(body), "a fixed figure the heartbeat no longer has"
    body.update(_COMBINER_FIXED)
    s.add(
        "metrics-combiner",
        "metrics-combiner",
        TOPICS.metrics("combiner", f"{TEMPS.name}-0"),
        orjson.dumps(body),
    )
    worker = Worker(WorkerConfig(TEMPS, BrokerSettings(), TOPICS, worker_id=WORKER_ID), s.clock)
    counters = worker.counters
    counters.batches, counters.rows, counters.deadletters, counters.partials = 5, 9, 2, 5
    for ms in (0.8, 1.1, 2.4):
        worker.stats.handle_latency.add(ms)
    for ms in (3.0, 4.0, 9.0):
        worker.stats.publish_latency.add(ms)
    body = worker.metrics()
    assert set(_WORKER_FIXED) <= set(body), "a fixed figure the heartbeat no longer has"
    body.update(_WORKER_FIXED)
    s.add(
        "metrics-worker", "metrics-worker", TOPICS.metrics("worker", WORKER_ID), orjson.dumps(body)
    )
    # The worker's MQTT will, as Worker.run sets it.
    gone = orjson.dumps({"component": "worker", "id": WORKER_ID, "state": "gone"})
    s.add("metrics-worker-gone", "metrics-worker", TOPICS.metrics("worker", WORKER_ID), gone)


PIPELINE_TOML: Final = """\
name = "temps"
aggregates = ["count", "mean", "median"]
lateness_ms = 1000

[[windows]]
size_ms = 10000
"""
"""The spec ``shoal pipeline deploy`` sends: aliases (median) and defaults left implicit."""


def _pipelines(s: _Scenario) -> None:
    """Requests through ``Registry`` as ``ControlPlane.handle`` runs them; what it publishes."""
    registry = Registry()
    reply, request_topic = TOPICS.pipeline_reply(CLIENT_ID), TOPICS.pipeline_request(CLIENT_ID)

    deploy = Request("deploy", "3f6c1e0a9b2d4c57", spec_toml=PIPELINE_TOML)
    s.add("pipeline-request", "pipeline-request", request_topic, deploy.to_json())
    s.clock.advance(100)
    result, document = registry.decide(deploy, s.clock.now_ms())
    assert document is not None
    registry.commit(document)
    s.add("pipeline-result", "pipeline-result", reply, result.to_json())
    topic = TOPICS.pipeline_document(document.name)
    s.add("pipeline-document", "pipeline-document", topic, document.to_json())
    bad = Request("deploy", "8d1e5b7f20a34c96", spec_toml=PIPELINE_TOML.replace("10000", "0"))
    refused, _ = registry.decide(bad, s.clock.now_ms())
    s.add("pipeline-result-refused", "pipeline-result", reply, refused.to_json())
    try:
        Request.from_json(b"{not json")
    except ControlError as exc:
        unreadable = refuse_unreadable(exc)
    else:
        raise AssertionError("a request that is not JSON was read")
    s.add("pipeline-result-unreadable", "pipeline-result", reply, unreadable.to_json())
    delete = Request("delete", "c40b9e2d71f85a13", name="temps")
    s.add("pipeline-request-delete", "pipeline-request", request_topic, delete.to_json())
    s.clock.advance(100)
    _, tombstone = registry.decide(delete, s.clock.now_ms())
    assert tombstone is not None
    s.add("pipeline-document-deleted", "pipeline-document", topic, tombstone.to_json())


def _announcement(s: _Scenario) -> None:
    """What a pool combiner retains on ``shoal/combiners/<id>`` (``CombinerHost._announce``)."""
    # Updated to v2: partition 1 still finishes the windows before its cut under v1.
    owns = (Owned("temps", 0, 2, 2), Owned("temps", 1, 2, 2, (1, 2)))
    announcement = Announcement("edge-7-4242", s.clock.now_ms(), owns)
    topic = TOPICS.pool_combiner(announcement.id)
    s.add("combiner-announcement", "combiner-announcement", topic, announcement.to_json())


def output_cases() -> list[OutputCase]:
    """Every golden output message, built by running the scenario (deterministic)."""
    s = _Scenario()
    runtime = _temps(s)
    _deadletters(s)
    _by_unit(s)
    _control(s)
    _metrics(s, runtime)
    _pipelines(s)
    _announcement(s)
    _corrections(s)
    _counts(s)
    _sessions(s)
    _parts(s)
    _alerts(s)
    _session_corrections(s)  # last: it advances the scenario's clock
    return s.cases
