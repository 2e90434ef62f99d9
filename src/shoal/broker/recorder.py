"""A subscriber in C that records when each message arrives: ``mosquitto_sub`` in a process.

Measuring how late a message reaches a subscriber needs a subscriber whose own receive path
costs next to nothing. paho's, in Python, costs about half a millisecond per message
(docs/benchmarks.md, "Adapter"), so the 30th message of a burst is stamped 15 ms after it
arrived; a dashboard written in Go or JavaScript, or ``mosquitto_sub``, is far faster.
``RecordingSubscriber`` runs Mosquitto's own client, which writes every message with its
arrival time (``%U``: Unix time, ns) to a file; ``records`` reads them back afterwards, so
nothing is parsed while the measurement runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shoal.broker.settings import BrokerSettings
from shoal.errors import BrokerError

BINARY: Final = "mosquitto_sub"
# Arrival time, retain flag, topic, payload length, payload as it came. Not ``%x``: printing
# a 240 kB window message in hex took mosquitto_sub 20 ms, and the alerts behind it waited.
_FORMAT: Final = "%U %r %t %l %p"
_HEADER: Final = re.compile(rb"(\d+\.\d+) ([01]) (\S+) (\d+) ")
_SUBSCRIBED: Final = b"Subscribed (mid:"  # what ``-d`` prints once the SUBACK came


@dataclass(frozen=True, slots=True)
class Recorded:
    """One message as the subscriber received it."""

    at_s: float
    """Arrival, Unix time in seconds (CLOCK_REALTIME)."""
    retain: bool
    topic: str
    payload: bytes


def available() -> bool:
    """Whether ``mosquitto_sub`` is on PATH (Debian: ``mosquitto-clients``)."""
    return shutil.which(BINARY) is not None


class RecordingSubscriber:
    """``mosquitto_sub`` subscribed to ``filters`` at QoS 1, recording into ``path``.

    Topics with spaces are not read back (shoal's never have any). TLS brokers are not
    supported (``BrokerError``): the benchmarks that use it start their
    own plain-TCP broker. The password, if any, is on the command line of a local process.
    """

    def __init__(
        self, settings: BrokerSettings, client_id: str, filters: Sequence[str], path: Path
    ) -> None:
        if settings.tls is not None:
            raise BrokerError("the recording subscriber speaks plain TCP only")
        binary = shutil.which(BINARY)
        if binary is None:
            raise BrokerError(f"{BINARY} is not on PATH (install mosquitto-clients)")
        self.path = path
        # Line-buffered (coreutils' stdbuf), so its SUBACK shows in the file as it comes.
        stdbuf = shutil.which("stdbuf")
        self._argv = [stdbuf, "-oL"] if stdbuf else []
        self._argv += [binary, "-d", "-V", "mqttv5", "-q", "1", "--nodelay"]
        self._argv += ["-h", settings.host, "-p", str(settings.port), "-i", client_id]
        if settings.username is not None:
            self._argv += ["-u", settings.username]
        if settings.password is not None:
            self._argv += ["-P", settings.password]
        for topic_filter in filters:
            self._argv += ["-t", topic_filter]
        self._argv += ["-F", _FORMAT]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait for its SUBACK (without ``stdbuf``: for its first message)."""
        with self.path.open("wb") as out:
            self._process = subprocess.Popen(self._argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while _SUBSCRIBED not in self.path.read_bytes():
            if self._process.poll() is not None:
                raise BrokerError(
                    f"{BINARY} exited with {self._process.returncode}: "
                    f"{self.path.read_bytes()[-300:].decode(errors='replace')}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"{BINARY} did not subscribe within {timeout_s:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Disconnect it (what it received is in the file)."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def records(self) -> Iterator[Recorded]:
        """The messages received, in order of arrival."""
        data = self.path.read_bytes()
        pos = 0
        while pos < len(data):
            header = _HEADER.match(data, pos)
            if header is None:  # ``-d`` protocol chatter: a line of its own
                end = data.find(b"\n", pos)
                pos = len(data) if end < 0 else end + 1
                continue
            start = header.end()
            size = int(header.group(4))
            yield Recorded(
                float(header.group(1)),
                header.group(2) == b"1",
                header.group(3).decode(),
                data[start : start + size],
            )
            pos = start + size + 1  # and the newline ``-F`` ends each message with
