"""shoal.observe: histogram buckets from the latency sketch, families, the endpoint, the flags."""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal._cli.common import add_metrics_options, metrics_address
from shoal.broker.settings import BrokerSettings
from shoal.errors import ConfigError
from shoal.observe import LATENCY_BUCKETS_S, Collector, Families, MetricsEndpoint, registry_of
from shoal.observe.collectors import SinkCollector
from shoal.runtime.latency import LatencyHistogram
from shoal.sinks.follow import FollowConfig, Follower
from shoal.sinks.postgres import PostgresStats
from shoal.sinks.webhook import WebhookStats

# -- buckets from the 2 %-wide latency sketch ------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_cumulative_buckets_are_within_the_sketch_error_of_the_exact_counts(seed: int) -> None:
    rng = random.Random(seed)
    samples = [rng.lognormvariate(3.0, 2.0) for _ in range(2_000)] + [0.0, 1.0, 100.0]
    histogram = LatencyHistogram()
    for ms in samples:
        histogram.add(ms)
    bounds = [b * 1000.0 for b in LATENCY_BUCKETS_S]
    counts = histogram.cumulative(bounds)
    assert counts == sorted(counts)
    for bound, n in zip(bounds, counts, strict=True):
        # Never more than the samples at or below the bound; never fewer than those 2 % below.
        assert (
            sum(1 for s in samples if s <= bound / 1.02)
            <= n
            <= sum(1 for s in samples if s <= bound)
        )
    assert histogram.total_ms == pytest.approx(sum(max(s, 0.001) for s in samples))


def test_merged_histograms_keep_their_sum() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    a.add(5.0)
    b.add(7.0)
    a.merge(b)
    assert (a.count, a.total_ms) == (2, 12.0)


# -- families through a registry and the text format -----------------------------------------------


class _Fixed(Collector):
    def __init__(self, latency: LatencyHistogram) -> None:
        self.latency = latency

    def collect(self) -> Iterator[object]:  # type: ignore[override]
        f = Families()
        f.counter("shoal_test_things_total", "Things.", {"reason": "a"}, 3)
        f.counter("shoal_test_things_total", "Things.", {"reason": "b"}, 4)
        f.counter("shoal_test_declared_total", "Declared, never seen.", {"reason": ""}, None)
        f.gauge("shoal_test_level", "A level.", {}, 2.5)
        f.gauge("shoal_test_unknown", "No value yet.", {}, None)
        f.histogram("shoal_test_seconds", "Latency.", {"pipeline": "p"}, self.latency)
        yield from f


def _parse(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
    }


def test_families_render_as_prometheus_text() -> None:
    latency = LatencyHistogram()
    for ms in (0.2, 3.0, 40.0, 40.0, 90_000.0):
        latency.add(ms)
    text = MetricsEndpoint([_Fixed(latency)]).render().decode()
    parsed = _parse(text)
    assert parsed["shoal_test_things"] == (
        "counter",
        [
            ("shoal_test_things_total", {"reason": "a"}, 3.0),
            ("shoal_test_things_total", {"reason": "b"}, 4.0),
        ],
    )
    assert parsed["shoal_test_declared"] == ("counter", [])
    assert parsed["shoal_test_level"] == ("gauge", [("shoal_test_level", {}, 2.5)])
    assert parsed["shoal_test_unknown"] == ("gauge", [])
    kind, samples = parsed["shoal_test_seconds"]
    assert kind == "histogram"
    buckets = {s[1]["le"]: s[2] for s in samples if s[0].endswith("_bucket")}
    assert buckets["0.0005"] == 1  # 0.2 ms
    assert buckets["0.005"] == 2  # 3 ms
    assert buckets["0.05"] == 4  # 40 ms twice
    assert buckets["60.0"] == 4  # 90 s is above every bound
    assert buckets["+Inf"] == 5
    count = next(s[2] for s in samples if s[0] == "shoal_test_seconds_count")
    total = next(s[2] for s in samples if s[0] == "shoal_test_seconds_sum")
    assert (count, total) == (5, pytest.approx(90.0832))
    assert "process_resident_memory_bytes" in parsed  # the process collector rides along


def test_a_registry_without_the_process_collector_has_only_the_collectors() -> None:
    registry = registry_of([_Fixed(LatencyHistogram())], process=False)
    assert {m.name for m in registry.collect()} == {
        "shoal_test_things",
        "shoal_test_declared",
        "shoal_test_level",
        "shoal_test_unknown",
        "shoal_test_seconds",
    }


def test_the_endpoint_serves_metrics_over_http_and_nothing_else() -> None:
    async def scenario() -> tuple[int, str, str, int]:
        endpoint = MetricsEndpoint([_Fixed(LatencyHistogram())], port=0)
        port = await endpoint.start()
        try:

            def get(path: str) -> tuple[int, str, str]:
                url = f"http://127.0.0.1:{port}{path}"
                try:
                    with urllib.request.urlopen(url, timeout=5) as response:
                        return (
                            response.status,
                            response.headers["Content-Type"],
                            response.read().decode(),
                        )
                except urllib.error.HTTPError as exc:
                    return exc.code, "", ""

            status, ctype, body = await asyncio.to_thread(get, "/metrics")
            missing, _, _ = await asyncio.to_thread(get, "/api/v1/scaling")
        finally:
            await endpoint.close()
        return status, ctype, body, missing

    status, ctype, body, missing = asyncio.run(scenario())
    assert status == 200
    assert ctype.startswith("text/plain")
    assert "shoal_test_things_total" in body
    assert missing == 404  # the scaler's KEDA endpoint is the scaler's alone


# -- the flags -------------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_metrics_options(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ((), {}, None),
        (("--metrics-port", "9464"), {}, ("127.0.0.1", 9464)),
        (("--metrics-port", "0"), {}, ("127.0.0.1", 0)),
        (("--metrics-port", "9464", "--metrics-host", "0.0.0.0"), {}, ("0.0.0.0", 9464)),
        ((), {"SHOAL_METRICS_PORT": "9500", "SHOAL_METRICS_HOST": "::1"}, ("::1", 9500)),
        (("--metrics-port", "-1"), {"SHOAL_METRICS_PORT": "9500"}, None),
        (("--metrics-port", "9464"), {"SHOAL_METRICS_PORT": "9500"}, ("127.0.0.1", 9464)),
    ],
)
def test_the_metrics_address_comes_from_flags_then_environment(
    argv: tuple[str, ...], env: dict[str, str], expected: tuple[str, int] | None
) -> None:
    assert metrics_address(_args(*argv), env) == expected


@pytest.mark.parametrize(
    ("argv", "env"), [(("--metrics-port", "70000"), {}), ((), {"SHOAL_METRICS_PORT": "http"})]
)
def test_a_bad_metrics_port_is_a_config_error(argv: tuple[str, ...], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"METRICS_PORT|metrics-port"):
        metrics_address(_args(*argv), env)


# -- the sinks' shared vocabulary ------------------------------------------------------------------


def _sink_families(
    kind: str, report: dict[str, object]
) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    follower = Follower(
        FollowConfig(BrokerSettings.from_url("mqtt://127.0.0.1:1"), ("r/p",), "sink"),
        handler=None,  # type: ignore[arg-type]  # never run: only its counters are read
    )
    follower.stats.acknowledged = 5
    collector = SinkCollector(kind, "p", follower, lambda: report)
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in collector.collect()}


def test_the_postgres_sinks_report_becomes_sink_families() -> None:
    stats = PostgresStats(messages=5, rows=9, rows_changed=7, rows_unchanged=2, db_retries=1)
    families = _sink_families("postgres", stats.to_dict())
    at = {"sink": "postgres", "pipeline": "p"}
    assert families["shoal_sink_messages"] == [("shoal_sink_messages_total", at, 5)]
    assert families["shoal_sink_acknowledged"] == [("shoal_sink_acknowledged_total", at, 5)]
    assert families["shoal_sink_db_retries"] == [("shoal_sink_db_retries_total", at, 1)]
    assert families["shoal_sink_rows"] == [
        ("shoal_sink_rows_total", {**at, "outcome": "changed"}, 7),
        ("shoal_sink_rows_total", {**at, "outcome": "unchanged"}, 2),
    ]
    assert "shoal_sink_deliveries" not in families  # a web hook's counter


def test_the_webhook_sinks_report_becomes_sink_families() -> None:
    stats = WebhookStats(messages=4, delivered=3, attempts=6, retries=2, refused={"410": 1})
    families = _sink_families("webhook", stats.to_dict())
    at = {"sink": "webhook", "pipeline": "p"}
    assert families["shoal_sink_deliveries"] == [("shoal_sink_deliveries_total", at, 3)]
    assert families["shoal_sink_delivery_retries"] == [("shoal_sink_delivery_retries_total", at, 2)]
    assert families["shoal_sink_refused"] == [
        ("shoal_sink_refused_total", {**at, "status": "410"}, 1)
    ]
    assert "shoal_sink_rows" not in families


def test_a_taken_metrics_port_is_a_config_error_and_the_process_does_not_start() -> None:
    from shoal._cli._metrics import exposed  # noqa: PLC0415 - the CLI's seam

    started = []

    async def main() -> None:
        started.append(True)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        collector = lambda: _Fixed(LatencyHistogram())  # noqa: E731
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            asyncio.run(exposed(main(), ("127.0.0.1", port), collector, "test"))
    assert started == []


def test_without_an_address_the_process_runs_alone() -> None:
    from shoal._cli._metrics import exposed  # noqa: PLC0415 - the CLI's seam

    async def main() -> int:
        return 7

    assert asyncio.run(exposed(main(), None, lambda: _Fixed(LatencyHistogram()), "test")) == 7
