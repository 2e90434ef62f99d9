"""How a gateway reads confirmations from a real broker: pipelines, partitions, retained state."""

from __future__ import annotations

import time

import numpy as np

from shoal.broker import ThreadedSession, unique_client_id
from shoal.broker.session import GatewaySession
from shoal.gateway import Gateway, GatewayConfig
from shoal.schemas.control import Confirm, GatewayStatus
from tests.integration._gateway_support import Confirmer

STREAM = "plant"


def _add(gateway: Gateway, start: int, rows: int = 100) -> None:
    index = start + np.arange(rows)
    gateway.add_many(np.array(["s"] * rows), np.full(rows, int(time.time() * 1000)), index * 1.0)
    gateway.flush()


def _retained(broker, topic: str, timeout_s: float = 5.0) -> bytes:
    got: list[bytes] = []

    def on_connect(session: GatewaySession) -> None:
        session.subscribe(topic)

    reader = ThreadedSession(
        broker.settings,
        unique_client_id("reader"),
        on_message=lambda m: got.append(m.payload),
        on_connect=on_connect,
    )
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        reader.stop()
    assert got, f"nothing retained on {topic}"
    return got[-1]


def test_confirm_from_waits_for_every_named_pipeline_and_all_partitions(broker, topics) -> None:
    config = GatewayConfig(
        "gw-multi",
        stream=STREAM,
        broker=broker.settings,
        topics=topics,
        confirm_from=("alpha", "beta"),
        status_interval_ms=100,
        resend_after_ms=500,
    )
    with Gateway(config) as gateway:
        with Confirmer(broker.settings, topics, STREAM, pipeline="alpha", partitions=3) as alpha:
            for chunk in range(5):
                _add(gateway, chunk * 100)
            assert alpha.wait_contiguous("gw-multi", 4, 10)
            # Alpha (all three partitions) has everything; beta has said nothing yet.
            assert not gateway.wait_confirmed(0.5)
            assert gateway.stats().spool_batches == 5
            with Confirmer(broker.settings, topics, STREAM, pipeline="beta") as beta:
                # Beta subscribed late: the batches reach it only when they are re-sent.
                assert beta.wait_contiguous("gw-multi", 4, 20)
                assert gateway.wait_confirmed(10)
        stats = gateway.stats()
        assert stats.spool_batches == 0
        assert stats.batches_confirmed == 5
        assert stats.confirmed_seq == 4
        assert stats.resends > 0
    status = GatewayStatus.from_json(_retained(broker, topics.gateway_status("gw-multi")))
    assert status.next_seq == 5
    assert status.first_unconfirmed_seq == 5
    assert status.unconfirmed_batches == 0
    assert status.rows_total == 500


def test_a_gateway_that_lost_its_spool_continues_above_the_pipelines_confirmation(
    broker, topics
) -> None:
    # The pipeline has applied seq 0..100 of gw-lost; a gateway restarted with an empty
    # (memory) spool would start at 0 and have every batch dropped as a duplicate.
    publisher = ThreadedSession(broker.settings, unique_client_id("pipeline"))
    publisher.start()
    assert publisher.wait_connected(10)
    confirm = Confirm("gw-lost", "test", 0, 1, 100, 1)
    publisher.publish(topics.confirm("gw-lost", "test", 0), confirm.to_json(), retain=True).wait(5)
    publisher.stop()

    config = GatewayConfig("gw-lost", stream=STREAM, broker=broker.settings, topics=topics)
    gateway = Gateway(config)
    _add(gateway, 0)  # sealed as seq 0 before the retained confirmation arrives
    assert gateway.stats().next_seq == 1
    with Confirmer(broker.settings, topics, STREAM) as confirmer:
        gateway.start()
        deadline = time.monotonic() + 10
        while gateway.stats().next_seq <= 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        _add(gateway, 100)
        gateway.close(timeout_s=1)
        time.sleep(0.3)
        got = confirmer.snapshot("gw-lost")
    # Seq 0 was re-sealed above the confirmation; nothing at or below 100 carries rows.
    assert all(seq > 100 for seq, values in got.rows.items() if len(values))
    received = np.sort(np.concatenate(list(got.rows.values())))
    np.testing.assert_array_equal(received, np.arange(200) * 1.0)
