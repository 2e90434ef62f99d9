"""The threaded (gateway) session under load: many QoS 1 publishes, PUBACKs racing them."""

from __future__ import annotations

import threading

from shoal.broker import EmbeddedBroker, ThreadedSession, unique_client_id


def test_publishing_while_pubacks_arrive_does_not_deadlock(broker: EmbeddedBroker, topics) -> None:
    session = ThreadedSession(broker.settings, unique_client_id("load"))
    session.start()
    try:
        assert session.wait_connected(10)
        handles = []

        def publish_many() -> None:
            handles.extend(
                session.publish(topics.ingest("s", "gw"), b"x" * 100) for _ in range(3000)
            )

        worker = threading.Thread(target=publish_many, daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "publish() deadlocked against paho's network thread"
        assert all(h.wait(10) for h in handles)
        assert all(h.is_acknowledged() for h in handles)
    finally:
        session.stop()
