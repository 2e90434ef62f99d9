"""Whether the broker holds to a client's Receive Maximum once the client acknowledges.

Run from the repository root (docs/benchmarks.md, "Workers under chaos: the receive maximum
held by the worker itself")::

    python docs/bench/mosquitto_receive_maximum.py

Starts the embedded broker (the dev profile, as every shoal process uses it), connects a
client announcing a Receive Maximum of 8 with manual acknowledgements, publishes 100 QoS 1
messages to it, then acknowledges the oldest one at a time. A broker that holds to the
Receive Maximum keeps 8 unacknowledged messages in flight; Mosquitto 2.0.11 lets 8 more in
with every acknowledgement of the oldest (upstream issue 2306, fixed in 2.0.13). Prints one
JSON line: the broker's version and the messages in flight after 0..5 acknowledgements.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shoal.broker._mosquitto import mosquitto_binary
from shoal.broker.embedded import EmbeddedBroker

RECEIVE_MAXIMUM = 8
MESSAGES = 100
SETTLE_S = 0.3


def _client(client_id: str, **options: bool) -> mqtt.Client:
    return mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id, protocol=mqtt.MQTTv5, **options)


def main() -> None:
    """Measure and print one JSON line."""
    with EmbeddedBroker() as broker:
        host, port = broker.settings.host, broker.settings.port
        received: list[int] = []
        worker = _client("worker", manual_ack=True)
        worker.on_message = lambda _c, _u, message: received.append(message.mid)
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.ReceiveMaximum = RECEIVE_MAXIMUM
        worker.connect(host, port, properties=props, clean_start=True)
        worker.loop_start()
        worker.subscribe("$share/g/work", qos=1)
        gateway = _client("gateway")
        gateway.connect(host, port)
        gateway.loop_start()
        time.sleep(SETTLE_S)
        for _ in range(MESSAGES):
            gateway.publish("work", b"x" * 1000, qos=1)
        time.sleep(SETTLE_S)
        in_flight = []
        for acknowledged in range(6):
            in_flight.append(len(received) - acknowledged)
            if acknowledged < 5:
                worker.ack(received[acknowledged], 1)
                time.sleep(SETTLE_S)
        worker.loop_stop()
        gateway.loop_stop()
    version = subprocess.run(
        [mosquitto_binary(), "-h"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[0]
    record = {
        "broker": version,
        "receive_maximum": RECEIVE_MAXIMUM,
        "in_flight_after_acks": in_flight,
        "holds_to_it": max(in_flight) <= RECEIVE_MAXIMUM,
    }
    sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
