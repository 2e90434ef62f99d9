"""The pool worker's routing on the in-memory broker: deploy, share an input, update, delete.

Logic only (no Mosquitto): which pipelines a pool worker subscribes for, which handler a
delivery reaches by its subscription identifier, when an old handler is dropped, and what
the heartbeat says. Delivery under failure is tested on Mosquitto
(``tests/integration/test_worker_pool.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson
import polars as pl

from shoal.broker.memory import MemoryBroker
from shoal.broker.session import Message, Session
from shoal.control.assignment import Announcement, Owned
from shoal.control.messages import PipelineDocument, Request
from shoal.control.registry import Registry
from shoal.runtime.pool import PoolRoutes
from shoal.runtime.worker import Worker, WorkerConfig
from shoal.schemas import Encoding, encode_batch
from shoal.schemas.topics import Topics
from tests.unit.schemas.test_output_contract import validator

TOPICS = Topics(root="pool")


def spec(name: str, size_ms: int = 1_000, inputs: str = "ingest/+/+") -> str:
    return (
        f'name = "{name}"\ninputs = ["{inputs}"]\naggregates = ["count", "sum"]\n'
        f"partitions = 2\n[[windows]]\nsize_ms = {size_ms}\n"
    )


class Admin:
    """Plays the control plane: decides requests with a registry, retains the documents."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.registry = Registry()

    async def send(self, op: str, text: str | None = None, name: str | None = None) -> int:
        request = Request(op, f"r-{op}", spec_toml=text, name=name)  # type: ignore[arg-type]
        result, document = self.registry.decide(request, 1_000)
        assert result.ok, result.message
        assert document is not None
        await self.publish(document)
        self.registry.commit(document)
        return document.version

    async def publish(self, document: PipelineDocument) -> None:
        topic = TOPICS.pipeline_document(document.name)
        await self.session.publish(topic, document.to_json(), retain=True)


def batch(seq: int) -> bytes:
    frame = pl.DataFrame({"sensor_id": ["a", "b"], "ts": [100, 2_100], "value": [1.0, 2.0]})
    return encode_batch(frame, gateway_id="g1", seq=seq, sent_at_ms=0, encoding=Encoding.JSON_ROWS)


@contextlib.asynccontextmanager
async def pool(memory: MemoryBroker) -> AsyncIterator[tuple[Worker, asyncio.Queue[Message]]]:
    """A pool worker, and a queue of every partial and heartbeat it publishes."""
    worker = Worker(
        WorkerConfig(None, memory.settings, TOPICS, worker_id="pool-1", heartbeat_ms=20),
        session_factory=memory.session_factory,
    )
    seen: asyncio.Queue[Message] = asyncio.Queue()
    async with memory.session(memory.settings, "probe") as probe:
        await probe.subscribe([TOPICS.under_root("shoal/partials/#"), TOPICS.metrics_all()])

        async def pump() -> None:
            async for message in probe.messages():
                seen.put_nowait(message)

        tasks = [asyncio.create_task(worker.run()), asyncio.create_task(pump())]
        try:
            yield worker, seen
        finally:
            worker.stop()
            tasks[1].cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def settle(seen: asyncio.Queue[Message], wait_s: float = 0.3) -> list[Message]:
    """Everything published within ``wait_s`` (heartbeats never let the queue go quiet)."""
    await asyncio.sleep(wait_s)
    got = []
    while not seen.empty():
        got.append(seen.get_nowait())
    return got


def partial_pipelines(messages: list[Message]) -> list[str]:
    """The pipeline of every partial, sorted (``shoal/partials/<pipeline>/<partition>``)."""
    return sorted(m.topic.split("/")[-2] for m in messages if "/partials/" in m.topic)


def serving(messages: list[Message]) -> dict[str, int]:
    """What the last heartbeat says the pool worker serves (checked against its schema)."""
    beats = [orjson.loads(m.payload) for m in messages if "/metrics/worker/" in m.topic]
    assert beats, "no heartbeat"
    validator("metrics-worker.schema.json").validate(beats[-1])
    assert beats[-1]["pipeline"] is None
    return beats[-1]["serving"]


async def announce(
    session: Session, member: str, owns: list[tuple[str, int, tuple[int, ...]]]
) -> None:
    """A pool combiner's retained announcement: (pipeline, partition, open versions)."""
    owned = tuple(Owned(name, k, 2, max(versions), versions) for name, k, versions in owns)
    await session.publish(
        TOPICS.pool_combiner(member), Announcement(member, 0, owned).to_json(), retain=True
    )


def routes(worker: Worker) -> PoolRoutes:
    assert isinstance(worker.routes, PoolRoutes)
    return worker.routes


def test_a_pool_worker_follows_deploy_update_and_delete() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        async with memory.session(memory.settings, "admin") as session:
            admin = Admin(session)
            await admin.send("deploy", spec("temps"))  # before the worker: retained
            async with pool(memory) as (worker, seen):
                await admin.send("deploy", spec("twin", 2_000))  # the same input
                await admin.send("deploy", spec("other", inputs="elsewhere/+/+"))
                await settle(seen)
                assert serving(await settle(seen)) == {"other": 1, "temps": 1, "twin": 1}

                await session.publish(TOPICS.ingest("s", "g1"), batch(0))
                got = await settle(seen)
                # One delivery per group, each to its own handler: 2 partitions each.
                assert partial_pipelines(got) == ["temps", "temps", "twin", "twin"]

                assert await admin.send("update", spec("temps", 5_000)) == 2
                assert serving(await settle(seen))["temps"] == 2  # as for the delete below
                await session.publish(TOPICS.ingest("s", "g1"), batch(1))
                got = await settle(seen)
                # Both versions compute the batch until the combiners close v1's windows.
                assert partial_pipelines(got) == ["temps"] * 4 + ["twin", "twin"]
                assert routes(worker).pipelines["temps"].handler.spec.windows[0].size_ms == 5_000
                assert [v for v, _ in routes(worker).pipelines["temps"].older] == [1]
                assert serving(got) == {"other": 1, "temps": 2, "twin": 1}
                # A pool combiner announces v1 closed on one partition: not yet enough.
                await announce(session, "c1", [("temps", 0, (2,)), ("temps", 1, (1, 2))])
                await settle(seen)
                assert [v for v, _ in routes(worker).pipelines["temps"].older] == [1]
                await announce(session, "c1", [("temps", 0, (2,)), ("temps", 1, (2,))])
                await settle(seen)
                assert routes(worker).pipelines["temps"].older == ()

                await admin.send("delete", name="twin")
                # Documents and batches are different topics: nothing orders a batch published
                # right after the delete behind it; wait until the worker has left twin's group.
                assert "twin" not in serving(await settle(seen))
                await session.publish(TOPICS.ingest("s", "g1"), batch(2))
                got = await settle(seen)
                assert partial_pipelines(got) == ["temps", "temps"]
                assert serving(got) == {"other": 1, "temps": 2}
                # The retire markers came back: the old handlers of temps v1 and twin are gone.
                assert len(routes(worker)._handlers) == 2
                assert worker.counters.unrouted == 0
                assert worker.counters.batches == 6

    asyncio.run(scenario())


def test_an_invalid_document_is_counted_and_stops_nothing_else() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        async with memory.session(memory.settings, "admin") as session:
            admin = Admin(session)
            async with pool(memory) as (worker, seen):
                await admin.send("deploy", spec("temps"))
                await session.publish(TOPICS.pipeline_document("broken"), b"{not json", retain=True)
                forged = PipelineDocument("forged", 1, "deployed", "sha256:0", {"name": "x"}, 0)
                await admin.publish(forged)
                await session.publish(TOPICS.ingest("s", "g1"), batch(0))
                got = await settle(seen)
                assert partial_pipelines(got) == ["temps", "temps"]
                assert serving(got) == {"temps": 1}
                assert routes(worker).follower.invalid == 2

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def temps_and_twin(
    memory: MemoryBroker,
) -> AsyncIterator[tuple[Session, Admin, Worker, asyncio.Queue[Message]]]:
    """Two pipelines on one input, deployed before a pool worker starts and serves them."""
    async with memory.session(memory.settings, "admin") as session:
        admin = Admin(session)
        await admin.send("deploy", spec("temps"))
        await admin.send("deploy", spec("twin", 2_000))
        async with pool(memory) as (worker, seen):
            assert serving(await settle(seen)) == {"temps": 1, "twin": 1}
            yield session, admin, worker, seen


def test_draining_a_pool_worker_leaves_every_group() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        async with temps_and_twin(memory) as (session, _, worker, seen):
            worker.drain()
            await asyncio.sleep(0.3)
            await session.publish(TOPICS.ingest("s", "g1"), batch(0))
            got = await settle(seen)
            assert partial_pipelines(got) == []
            assert worker.counters.batches == 0

    asyncio.run(scenario())


def test_after_a_lost_connection_the_pool_subscribes_everything_again() -> None:
    memory = MemoryBroker()

    async def scenario() -> None:
        async with temps_and_twin(memory) as (session, admin, worker, seen):
            memory.drop("pool-1")  # its shared subscriptions go with the connection
            await admin.send("delete", name="twin")  # while it is away
            await asyncio.sleep(0.8)  # it reconnects after reconnect_delay_s
            await session.publish(TOPICS.ingest("s", "g1"), batch(0))
            got = await settle(seen)
            assert worker.counters.reconnects == 1
            assert partial_pipelines(got) == ["temps", "temps"]
            assert serving(got) == {"temps": 1}

    asyncio.run(scenario())
