"""``shoal sink webhook``: at least once, with retries, backoff and an idempotency key.

A real Mosquitto and a real HTTP server (``http.server`` in a thread) that answers the
first requests 503 (and one 429 with ``Retry-After``): every window result of a live
pipeline arrives, copies of one result carry one key, and the receiver's deduplicated view
is exactly what a consumer of the results topic saw. Alert transitions (the shape issue 16
will define, assumed here) go the same way; a 400 is counted as refused and skipped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest

from shoal.broker import AsyncSession
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.cli import main as shoal_main
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from shoal.sinks import Backoff, FollowConfig, Follower, WebhookConfig, WebhookSink
from tests.support.datasets import make_batches, two_window_spec
from tests.support.live import InProcessPipeline, collector, publish_batches

pytestmark = pytest.mark.broker


@dataclass
class Receiver:
    """What the web hook's receiver got, and how it answers."""

    fail_first: int = 0
    throttle_once: bool = False
    refuse_alert: str = ""
    requests: list[tuple[dict[str, str], bytes, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str]]:
        with self.lock:
            n = len(self.requests) + 1
            status, extra = 204, {}
            if n <= self.fail_first:
                status = 503
            elif self.throttle_once and n == self.fail_first + 1:
                status, extra = 429, {"Retry-After": "0.3"}
            elif self.refuse_alert and self.refuse_alert.encode() in body:
                status = 400
            self.requests.append((headers, body, status))
        return status, extra

    def delivered(self) -> dict[str, bytes]:
        """Idempotency key -> body of the accepted requests (what a receiver keeps)."""
        with self.lock:
            requests = list(self.requests)
        out: dict[str, bytes] = {}
        for headers, body, status in requests:
            if 200 <= status < 300:
                out.setdefault(headers["idempotency-key"], body)
        return out


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, extra = state.answer(headers, body)
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def test_window_results_reach_the_webhook_once_per_key_through_failures(
    broker: EmbeddedBroker, topics: Topics, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    state, url = receiver
    state.fail_first, state.throttle_once = 3, True
    spec = two_window_spec("hooked", ["count", "mean", "max"], 2)
    batches = make_batches(seed=3, gateways=2, batches_per_gateway=10, rows_per_batch=(1, 30))

    async def scenario() -> list[dict]:
        sink = WebhookSink(WebhookConfig(url=url, retry=Backoff(0.05, 0.5)))
        follower = Follower(
            FollowConfig(broker.settings, (topics.results(spec.name),), unique_client_id("hook")),
            sink,
        )
        following = asyncio.create_task(follower.run())
        await asyncio.wait_for(follower.connected.wait(), 10)
        pipeline = InProcessPipeline(spec, broker.settings, topics, workers=2, state_dir=None)
        async with collector(broker.settings, topics, spec.name) as seen:
            await pipeline.start()
            order = list(range(len(batches)))
            await publish_batches(
                broker.settings, topics, batches, order, encoding=Encoding.JSON_ROWS
            )
            await pipeline.finish(batches)
            windows = list(seen.windows)
        # a window published again (as after a combiner restart): the same identity
        again = {**windows[0], "emitted_at": windows[0]["emitted_at"] + 1}
        async with AsyncSession(broker.settings, unique_client_id("again")) as session:
            await session.publish(topics.results(spec.name), orjson.dumps(again))
        for _ in range(100):
            if sink.stats.delivered == len(windows) + 1:
                break
            await asyncio.sleep(0.1)
        follower.stop()
        await following
        assert sink.stats.delivered == sink.stats.messages == len(windows) + 1, sink.stats
        assert sink.stats.retries == 4  # three 503 and one 429, all on the first message
        assert sink.stats.refused == {}
        return windows

    windows = asyncio.run(scenario())
    delivered = state.delivered()
    keys = {
        f"result/{w['pipeline']}/{w['window']}/{w['start']}/{w['partition']}/{w['revision']}/{w['rows']}"
        for w in windows
    }
    assert set(delivered) == keys
    assert len(state.requests) == len(windows) + 1 + 4  # every window, the copy, 4 retries
    for key, body in delivered.items():
        message = orjson.loads(body)
        assert key.startswith(
            f"result/{message['pipeline']}/{message['window']}/{message['start']}/"
        )
    assert [s for _, _, s in state.requests[:5]] == [503, 503, 503, 429, 204]
    headers = state.requests[-1][0]
    assert headers["content-type"] == "application/json"
    assert headers["x-shoal-topic"] == topics.results(spec.name)


def test_alert_transitions_through_the_cli(
    broker: EmbeddedBroker, topics: Topics, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    state, url = receiver
    state.fail_first = 2
    state.refuse_alert = "refuse-me"
    firing = {
        "shoal": 1,
        "pipeline": "temps",
        "alert": "too-hot",
        "key": "t1",
        "state": "firing",
        "window": "tumbling-10s",
        "start": 1_700_000_000_000,
        "value": 31.5,
    }
    messages = [
        firing,
        firing,  # a duplicate delivery: the same key
        {**firing, "state": "resolved", "value": 24.0},
        {**firing, "alert": "refuse-me"},
    ]

    async def publish() -> None:
        async with AsyncSession(broker.settings, unique_client_id("alerts")) as session:
            for message in messages:
                await session.publish(
                    topics.under_root(f"shoal/alerts/temps/{message['alert']}"),
                    orjson.dumps(message),
                    content_type="application/json",
                )

    report = tmp_path / "hook.json"
    args = [
        "sink",
        "webhook",
        "--url",
        url,
        "--pipeline",
        "temps",
        "--alerts",
        "--header",
        "Authorization: Bearer t0ken",
        "--max-backoff",
        "0.2",
        "--heartbeat",
        "0",
        "--json",
        str(report),
        "--broker",
        broker.settings.url,
        "--topic-root",
        topics.root,
    ]
    # First run: subscribe (the persistent session is created), publish while it runs.
    done = threading.Event()

    def publish_soon() -> None:
        asyncio.run(asyncio.sleep(1.5))
        asyncio.run(publish())
        done.set()

    publisher = threading.Thread(target=publish_soon)
    publisher.start()
    assert shoal_main([*args, "--duration", "6"]) == 0
    publisher.join()
    stats = orjson.loads(report.read_bytes())
    assert stats["messages"] == 4
    assert stats["delivered"] == 3
    assert stats["refused"] == {"400": 1}
    assert stats["retries"] == 2
    assert stats["mqtt_acknowledged"] == 4
    delivered = state.delivered()
    assert set(delivered) == {
        "alert/temps/too-hot/t1/tumbling-10s/1700000000000/firing",
        "alert/temps/too-hot/t1/tumbling-10s/1700000000000/resolved",
    }
    assert [s for _, _, s in state.requests] == [503, 503, 204, 204, 204, 400]
    assert all(h["authorization"] == "Bearer t0ken" for h, _, _ in state.requests)
