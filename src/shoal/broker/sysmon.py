"""Mosquitto's ``$SYS`` counters: what the broker itself says about drops and queues."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

SYS_TOPICS: Final = {
    "$SYS/broker/publish/messages/dropped": "dropped",
    "$SYS/broker/store/messages/count": "stored",
    "$SYS/broker/store/messages/bytes": "stored_bytes",
    "$SYS/broker/clients/connected": "clients",
    "$SYS/broker/messages/received": "received",
    "$SYS/broker/messages/sent": "sent",
}
"""The ``$SYS`` topics shoal reads, and the names it reports them under."""


@dataclass
class BrokerCounters:
    """The latest value of each ``$SYS`` counter (None until the broker has sent it)."""

    values: dict[str, int | None] = field(
        default_factory=lambda: dict.fromkeys(SYS_TOPICS.values())
    )

    def take(self, topic: str, payload: bytes) -> bool:
        """Record one ``$SYS`` message; False if the topic is not one of ``SYS_TOPICS``."""
        name = SYS_TOPICS.get(topic)
        if name is None:
            return False
        try:
            self.values[name] = int(float(payload.decode().strip()))
        except (UnicodeDecodeError, ValueError):
            return False
        return True
