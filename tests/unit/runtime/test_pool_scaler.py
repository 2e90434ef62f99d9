"""The pool scaler's monitor: the sum of the lags of every computation deployed at run time."""

from __future__ import annotations

from shoal.broker.session import Message
from shoal.clock import FakeClock
from shoal.control.messages import PipelineDocument, Request
from shoal.control.registry import Registry
from shoal.runtime.scaler import PoolMonitor
from shoal.scaler.signals import signals_from
from shoal.schemas.topics import Topics
from tests.unit.scaler.test_monitor import confirm, status

T = Topics()


def spec(name: str, partitions: int = 1, size_ms: int = 10_000) -> str:
    return (
        f'name = "{name}"\naggregates = ["count"]\npartitions = {partitions}\n'
        f"[[windows]]\nsize_ms = {size_ms}\n"
    )


def documents(registry: Registry, *requests: Request) -> list[PipelineDocument]:
    out = []
    for request in requests:
        result, document = registry.decide(request, 0)
        assert result.ok, result.message
        assert document is not None
        registry.commit(document)
        out.append(document)
    return out


def as_message(document: PipelineDocument) -> Message:
    return Message(T.pipeline_document(document.name), document.to_json())


def test_the_pool_lag_is_the_sum_over_deployed_computations() -> None:
    registry = Registry()
    monitor = PoolMonitor(T, FakeClock())
    deployed = documents(
        registry,
        Request("deploy", "1", spec_toml=spec("a")),
        Request("deploy", "2", spec_toml=spec("b", partitions=2, size_ms=5_000)),
        Request("deploy", "3", spec_toml=spec("c")),  # the same as a: an alias, no work
    )
    assert deployed[2].alias_of == "a"
    for document in deployed:
        monitor.on_message(as_message(document))
    assert sorted(monitor.monitors) == ["a", "b"]
    monitor.on_message(status("g1", next_seq=11, first_unconfirmed=0, rows=1_100))
    monitor.on_message(confirm("g1", 7, pipeline="a"))  # a: 3 batches behind
    monitor.on_message(confirm("g1", 9, 0, 2, pipeline="b"))
    monitor.on_message(confirm("g1", 4, 1, 2, pipeline="b"))  # b: 6 behind (slowest partition)
    snap = monitor.snapshot()
    assert snap.lag_batches == 3 + 6
    assert snap.lag_rows == 2 * 1_100  # each computation has the gateway's backlog to do
    assert signals_from(snap, 0.0, 1).backlog_rows == 2 * 1_100
    # Deleting b leaves a's lag only.
    (tombstone,) = documents(registry, Request("delete", "4", name="b"))
    monitor.on_message(as_message(tombstone))
    assert sorted(monitor.monitors) == ["a"]
    assert monitor.snapshot().lag_batches == 3


def test_no_deployed_pipeline_means_no_lag() -> None:
    snap = PoolMonitor(T, FakeClock()).snapshot()
    assert (snap.lag_batches, snap.lag_rows, snap.workers) == (0, 0, ())


def test_a_computation_deployed_after_the_statuses_starts_from_them() -> None:
    """Subscribing, the scaler gets the retained gateway statuses and confirmations before
    (or between) the documents; a gateway may not speak again for a while. Found by
    tests/integration/test_pool_scaler_live.py: the pool's lag stayed 0."""
    registry = Registry()
    monitor = PoolMonitor(T, FakeClock())
    monitor.on_message(status("g1", next_seq=11, first_unconfirmed=0, rows=1_100))
    monitor.on_message(confirm("g1", 7, pipeline="a"))
    for document in documents(registry, Request("deploy", "1", spec_toml=spec("a"))):
        monitor.on_message(as_message(document))
    snap = monitor.snapshot()
    assert (snap.lag_batches, snap.lag_rows) == (3, 1_100)
