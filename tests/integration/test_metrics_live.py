"""Prometheus ``/metrics`` of real processes on a real Mosquitto, and the Grafana dashboard.

One deployment for the module: a control plane, a pool worker and a pool combiner serving a
deployed pipeline, a pinned worker and combiner serving another, an adapter acting as the
gateway of both, an archiver, a web hook sink and a PostgreSQL sink (a real server) following
the pinned pipeline's results, and a scaler watching a third pipeline. Devices publish through
the adapter (one message unreadable), a gateway-less garbage batch goes to the ingest topic.
Every process is scraped over HTTP and parsed with ``prometheus_client.parser``; the counters
must equal what was sent, and every metric the Grafana dashboard queries must be exposed by
one of them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal._spawn import spawn_tied
from shoal.broker.embedded import EmbeddedBroker
from shoal.loadtest.devices import DeviceFleet, DevicePublisher
from shoal.loadtest.postgres import EmbeddedPostgres
from shoal.schemas.topics import Topics

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "shoal.json"
STREAM = "devices"
DEVICES = 12
STEPS = 8
SIZE_MS = 2_000
LATENESS_MS = 1_000
PINNED = "metered"
POOLED = "pooled"
SETTINGS = {"size_ms": SIZE_MS, "lateness_ms": LATENESS_MS}
WATCHED = "watched"  # only the scaler's: it may start a worker of its own for it
SHOAL = [sys.executable, "-m", "shoal.cli"]

SPEC = """
name = "{name}"
inputs = ["ingest/+/+"]
key = "sensor_id"
lateness_ms = {lateness_ms}
idle_timeout_ms = 1500
partitions = {partitions}
checkpoint_interval_ms = 500
aggregates = ["count", "mean", "min", "max"]

[[windows]]
kind = "tumbling"
size_ms = {size_ms}

[limits]
max_future_ms = false
"""

MAPPING = """
name = "meters"
stream = "{stream}"
max_future_ms = false

[batching]
max_rows = 40
max_delay_ms = 50

[[routes]]
topic = "{root}/sensors/{{site}}/{{device}}"
format = "json-object"
sensor_id = "{{site}}.{{device}}"
fields = ["temp", "hum"]
timestamp = {{ field = "ts", unit = "ms" }}
"""


@dataclass
class Process:
    """One ``shoal`` command with ``--metrics-port 0``, and the URL it printed."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    url: str = ""

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = spawn_tied(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def wait_url(self, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.url:
            found = re.search(r"metrics on (http://\S+/metrics)", self.log.read_text())
            if found:
                self.url = found.group(1)
                break
            assert self.popen is not None
            assert self.popen.poll() is None, f"{self.name} exited:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"{self.name} serves no metrics:\n{self.tail()}"
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@dataclass
class Scrape:
    """One ``/metrics`` page, parsed: sample values by (name, labels) and the family types."""

    text: str
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, url: str) -> Scrape:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            text = response.read().decode()
        scrape = cls(text)
        for family in text_string_to_metric_families(text):
            scrape.types[family.name] = family.type
            for sample in family.samples:
                scrape.samples[sample.name, frozenset(sample.labels.items())] = sample.value
        return scrape

    def value(self, name: str, **labels: str) -> float:
        """The sample named ``name`` with exactly ``labels``."""
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"no {name}{labels}; have {sorted(self.names())}"
        return self.samples[key]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def applied(self) -> list[float]:
        """``shoal_combiner_measurements_total`` of each partition, by pipeline and partition."""
        name = "shoal_combiner_measurements_total"
        found = sorted(
            (dict(ls)["pipeline"], dict(ls)["partition"], v)
            for (n, ls), v in self.samples.items()
            if n == name
        )
        return [v for _, _, v in found]

    def labelled(self, name: str) -> list[dict[str, str]]:
        return [dict(ls) for n, ls in self.samples if n == name]

    def names(self) -> set[str]:
        """Every name a query may use: sample names, and those of families without samples."""
        names = {n for n, _ in self.samples}
        for family, kind in self.types.items():
            names |= {
                "counter": {f"{family}_total"},
                "histogram": {f"{family}_bucket", f"{family}_sum", f"{family}_count"},
            }.get(kind, {family})
        return names


class Deployment:
    """The module's processes (see the module docstring)."""

    def __init__(self, broker: EmbeddedBroker, topics: Topics, tmp: Path, hook_url: str) -> None:
        self.broker = broker
        self.topics = topics
        self.tmp = tmp
        self.hook_url = hook_url
        self.processes: dict[str, Process] = {}

    def shoal(self, name: str, *args: str) -> Process:
        argv = [*SHOAL, *args, "--metrics-port", "0"]
        argv += ["--broker", self.broker.settings.url, "--topic-root", self.topics.root]
        process = Process(name, argv, self.tmp / f"{name}.log")
        process.start()
        self.processes[name] = process
        return process

    def scrape(self, name: str) -> Scrape:
        return Scrape.of(self.processes[name].wait_url())

    def stop(self) -> None:
        for process in reversed(self.processes.values()):
            process.stop()


def _hook_server() -> tuple[ThreadingHTTPServer, list[bytes]]:
    received: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    return server, received


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("metrics")
    broker = EmbeddedBroker("dev", data_dir=tmp / "broker")
    broker.start()
    topics = Topics(root="metrics-live")
    server, _ = _hook_server()
    database = EmbeddedPostgres()
    database.start()
    hook = f"http://127.0.0.1:{server.server_address[1]}/hook"
    d = Deployment(broker, topics, tmp, hook)
    try:
        pinned, pooled = tmp / f"{PINNED}.toml", tmp / f"{POOLED}.toml"
        pinned.write_text(SPEC.format(name=PINNED, partitions=1, **SETTINGS))
        pooled.write_text(SPEC.format(name=POOLED, partitions=2, **SETTINGS))
        mapping = tmp / "mapping.toml"
        mapping.write_text(MAPPING.format(stream=STREAM, root=topics.root))
        d.shoal("control", "control")
        d.shoal("pool-worker", "worker")
        d.shoal("pool-combiner", "combiner", "--state-dir", str(tmp / "pool-state"))
        d.shoal("worker", "worker", "--pipeline", str(pinned))
        d.shoal(
            "combiner", "combiner", "--pipeline", str(pinned), "--state-dir", str(tmp / "state")
        )
        d.shoal("archive", "archive", "--dir", str(tmp / "archive"))
        d.shoal("sink", "sink", "webhook", "--pipeline", PINNED, "--url", hook)
        d.shoal("pg-sink", "sink", "postgres", "--dsn", database.dsn, "--pipeline", PINNED)
        watched = tmp / f"{WATCHED}.toml"
        watched.write_text(SPEC.format(name=WATCHED, partitions=1, **SETTINGS))
        scale = ["scaler", "--pipeline", str(watched), "--min", "0", "--max", "1"]
        d.shoal("scaler", "-v", *scale, "--log-dir", str(tmp / "scaler-logs"))
        for process in d.processes.values():
            process.wait_url()
        connect = ["--broker", broker.settings.url, "--topic-root", topics.root]
        deploy = subprocess.run(
            [*SHOAL, "pipeline", "deploy", str(pooled), "--timeout", "30", *connect],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        adapt = ["adapt", "--mapping", str(mapping), "--id", "meter-gw"]
        d.shoal("adapter", "-v", *adapt, "--spool-dir", str(tmp / "adapter-spool"))
        d.processes["adapter"].wait_url()
        _until(lambda: "subscribed" in d.processes["adapter"].log.read_text(), 60, "adapter")
        fleet = DeviceFleet("json", DEVICES, prefix=f"{topics.root}/sensors")
        messages = [
            *fleet.messages(0, STEPS),
            (fleet.topic(0), b"{not json"),  # the adapter dead-letters it
            (topics.ingest(STREAM, "no-such-gateway"), b"\x00garbage"),  # the workers do
        ]
        report = DevicePublisher(broker.settings).run(iter(messages))
        assert report.acknowledged == report.sent == len(messages)
        rows = DEVICES * STEPS * 2
        # Every partition applies every batch (its keys' share of it) and counts its rows.
        for name, partitions in (("combiner", 1), ("pool-combiner", 2)):
            _until(
                lambda name=name, partitions=partitions: (
                    d.scrape(name).applied() == [rows] * partitions
                ),
                120,
                f"{name} to apply every measurement",
            )
        # The windows ending before the watermark minus the lateness close (the last stays
        # open: nothing newer comes); the sinks follow their results.
        for name in ("combiner", "pool-combiner"):
            _until(
                lambda name=name: (
                    d.scrape(name).total("shoal_combiner_windows_closed_total")
                    == closable_windows() * (2 if name == "pool-combiner" else 1)
                ),
                60,
                f"{name} to close every closable window",
            )
        _until(lambda: d.scrape("sink").total("shoal_sink_messages_total") > 0, 60, "the sink")
        # Both sinks follow the same results: each has handled every one once it is drained.
        _until(
            lambda: (
                d.scrape("pg-sink").total("shoal_sink_messages_total")
                == d.scrape("sink").total("shoal_sink_messages_total")
                == d.scrape("sink").total("shoal_sink_deliveries_total")
            ),
            60,
            "both sinks to drain the results",
        )
        # Every batch confirmed: nothing is re-sent while the tests read the counters.
        _until(
            lambda: d.scrape("adapter").total("shoal_gateway_unconfirmed_batches") == 0,
            60,
            "every batch to be confirmed",
        )
        yield d
    except BaseException:
        for process in d.processes.values():
            sys.stderr.write(f"--- {process.name}\n{process.tail()}\n")
        raise
    finally:
        d.stop()
        server.shutdown()
        server.server_close()
        database.cleanup()
        broker.close()


def test_each_process_counts_what_it_was_sent(deployment: Deployment) -> None:
    rows = DEVICES * STEPS * 2
    adapter = deployment.scrape("adapter")
    assert adapter.value("shoal_adapter_messages_total", mapping="meters") == DEVICES * STEPS + 1
    assert adapter.value("shoal_adapter_measurements_total", mapping="meters") == rows
    assert adapter.total("shoal_adapter_deadletters_total", mapping="meters") == 1
    (refused,) = adapter.labelled("shoal_adapter_deadletters_total")
    assert refused["reason"]
    batches = adapter.value("shoal_gateway_batches_published_total", gateway="meter-gw")
    assert batches >= 1
    # A batch re-sent before its confirmation came is handled again, then dropped by combiners.
    resent = adapter.value("shoal_gateway_resends_total", gateway="meter-gw")
    for name, pipeline in (("worker", PINNED), ("pool-worker", POOLED)):
        worker = deployment.scrape(name)
        measured = worker.value("shoal_worker_measurements_total")
        assert measured == rows if not resent else measured > rows  # re-sends count again
        assert worker.value("shoal_worker_batches_total") == batches + resent
        assert worker.value("shoal_worker_pipelines") == 1
        # The garbage batch: one dead letter, labelled with its pipeline and a reason.
        (letter,) = worker.labelled("shoal_worker_deadletters_total")
        assert letter["pipeline"] == pipeline
        assert worker.value("shoal_worker_deadletters_total", **letter) == 1
        assert worker.value("shoal_worker_batch_handle_seconds_count") == batches + resent + 1
    combiner = deployment.scrape("combiner")
    at = {"pipeline": PINNED, "partition": "0"}
    assert combiner.value("shoal_combiner_measurements_total", **at) == rows
    assert combiner.value("shoal_combiner_batches_applied_total", **at) == batches
    assert combiner.value("shoal_combiner_duplicate_batches_total", **at) == resent
    assert combiner.value("shoal_combiner_late_measurements_total", **at) == 0
    assert combiner.value("shoal_combiner_windows_closed_total", **at) == closable_windows() > 0
    assert combiner.value("shoal_combiner_apply_latency_seconds_count", **at) == batches
    inf = combiner.value("shoal_combiner_apply_latency_seconds_bucket", le="+Inf", **at)
    assert inf == batches
    # One sample per close that published results (the closable windows closed together).
    assert combiner.value("shoal_combiner_result_latency_seconds_count", **at) >= 1
    assert combiner.value("shoal_combiner_result_latency_seconds_sum", **at) > 0
    assert combiner.value("shoal_combiner_watermark_seconds", **at) >= fleet_start_s()
    # Everything applied and confirmed (the fixture waited): no lag anywhere.
    assert combiner.value("shoal_combiner_lag_batches", **at) == 0
    assert adapter.value("shoal_gateway_unconfirmed_batches", gateway="meter-gw") == 0
    assert combiner.value("shoal_combiner_gateways", **at) == 1
    pool = deployment.scrape("pool-combiner")
    assert pool.value("shoal_combiner_pool_owned_partitions", pipeline=POOLED) == 2
    assert pool.value("shoal_combiner_pool_pipelines_deployed") == 1
    assert pool.applied() == [rows, rows]
    assert pool.total("shoal_combiner_batches_applied_total", pipeline=POOLED) == 2 * batches
    control = deployment.scrape("control")
    assert control.value("shoal_control_pipelines_deployed") == 1
    assert control.value("shoal_control_requests_total", outcome="accepted") == 1
    archive = deployment.scrape("archive")
    assert archive.value("shoal_archive_batches_total") == batches + 1  # the garbage too
    sink = deployment.scrape("sink")
    labels = {"sink": "webhook", "pipeline": PINNED}
    handled = sink.value("shoal_sink_messages_total", **labels)
    assert handled == sink.value("shoal_sink_deliveries_total", **labels) > 0
    scaler = deployment.scrape("scaler")
    assert scaler.value("shoal_lag_batches", pipeline=WATCHED) >= 0
    database = deployment.scrape("pg-sink")
    labels = {"sink": "postgres", "pipeline": PINNED}
    assert database.value("shoal_sink_messages_total", **labels) == handled
    assert database.value("shoal_sink_acknowledged_total", **labels) == handled
    changed = database.value("shoal_sink_rows_total", outcome="changed", **labels)
    assert changed == combiner.value("shoal_combiner_result_rows_total", **at) > 0
    assert database.value("shoal_sink_unreadable_messages_total", **labels) == 0
    for scrape in (adapter, combiner, pool, control, archive, sink, scaler, database):
        assert scrape.value("process_resident_memory_bytes") > 0


def closable_windows() -> int:
    """Windows (with data) that end at or before the last event time minus the lateness."""
    fleet = DeviceFleet("json", 1)
    threshold = fleet.ts(STEPS - 1) - LATENESS_MS
    starts = {fleet.ts(step) // SIZE_MS * SIZE_MS for step in range(STEPS)}
    return sum(1 for start in starts if start + SIZE_MS <= threshold)


def fleet_start_s() -> float:
    return DeviceFleet("json", 1).ts(0) / 1000.0


QUERY_NAME = re.compile(r"\b((?:shoal|process)_[a-z0-9_]+)\b")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel (rows included)."""

    def panels(items: list[dict[str, object]]) -> Iterator[dict[str, object]]:
        for panel in items:
            yield panel
            inner = panel.get("panels")
            if isinstance(inner, list):
                yield from panels(inner)

    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in panels(board["panels"]):
        for target in panel.get("targets", []):  # type: ignore[attr-defined]
            found.append((str(panel["title"]), str(target["expr"])))
    for variable in board["templating"]["list"]:
        if variable.get("type") == "query":
            query = variable["query"]
            found.append((f"${variable['name']}", str(query.get("query", query))))
    return found


def test_every_metric_the_dashboard_queries_is_exposed(deployment: Deployment) -> None:
    exposed: set[str] = set()
    for name in deployment.processes:
        exposed |= deployment.scrape(name).names()
    queried = {m for _, expr in dashboard_queries() for m in QUERY_NAME.findall(expr)}
    assert len(queried) >= 15  # the parse found the panels' metrics
    missing = [
        (title, m)
        for title, expr in dashboard_queries()
        for m in QUERY_NAME.findall(expr)
        if m not in exposed
    ]
    assert not missing, f"queried but exposed by no process: {sorted(missing)}"


def test_the_dashboard_check_catches_an_unknown_metric(deployment: Deployment) -> None:
    exposed = deployment.scrape("worker").names()
    assert "shoal_worker_batches_total" in exposed
    assert "shoal_worker_batches" not in exposed  # a counter is queried with its _total
    assert QUERY_NAME.findall("sum(rate(shoal_worker_batchez_total[1m]))") == [
        "shoal_worker_batchez_total"
    ]


def test_every_exposed_metric_is_documented(deployment: Deployment) -> None:
    documented = set(re.findall(r"`(shoal_[a-z0-9_]+)", (REPO / "docs" / "metrics.md").read_text()))
    exposed = set()
    for name in deployment.processes:
        for family, kind in deployment.scrape(name).types.items():
            if family.startswith("shoal_"):
                exposed.add(f"{family}_total" if kind == "counter" else family)
    assert len(exposed) > 50
    assert exposed <= documented, f"not in docs/metrics.md: {sorted(exposed - documented)}"
