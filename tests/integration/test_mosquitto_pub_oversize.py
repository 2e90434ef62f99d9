"""What the README says of ``mosquitto_pub`` and oversize messages, checked against Mosquitto.

MQTT 5: the client learns the broker's maximum packet size from CONNACK, does not send a
larger message, and still exits 0 (nothing reaches the broker). MQTT 3.1.1: it sends it, the
broker disconnects it for an oversize packet (in the broker's log) and it exits non-zero.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas.topics import Topics

LIMIT = 16_777_216  # the dev profile's max_packet_size (broker/dev.conf)


@pytest.mark.skipif(shutil.which("mosquitto_pub") is None, reason="needs mosquitto_pub")
@pytest.mark.broker_quirk(
    "mosquitto",
    reason="measures mosquitto_pub against Mosquitto's own oversize handling",
    run=False,
)
def test_mosquitto_pub_drops_an_oversize_message_silently_with_mqtt5(
    broker: EmbeddedBroker, topics: Topics, tmp_path: Path
) -> None:
    assert (
        f"max_packet_size {LIMIT}"
        in (Path(__file__).parents[2] / "broker" / "dev.conf").read_text()
    )
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (LIMIT + 10))
    base = ["mosquitto_pub", "-h", broker.settings.host, "-p", str(broker.settings.port)]
    base += ["-q", "1", "-t", topics.ingest("s", "gw"), "-f", str(big), "-d"]

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)

    v5 = run(*base, "-V", "5")
    assert v5.returncode == 0
    assert "sending PUBLISH" not in v5.stdout  # never sent

    v311 = run(*base, "-V", "311")
    assert v311.returncode == 7  # "The connection was lost."
    assert "sending PUBLISH" in v311.stdout
    for _ in range(50):
        if "oversize packet" in broker.log_path.read_text():
            break
        time.sleep(0.1)
    log = broker.log_path.read_text()
    assert log.count("disconnected due to oversize packet") == 1  # the 3.1.1 one only
