"""paho's ``Properties`` against shoal's ``LeanProperties``: construction, unpack, size.

Run: ``.venv/bin/python docs/bench/paho_properties.py`` (figures in docs/benchmarks.md,
"Many pipelines on the pools"; 20,000 calls each, one process, no broker).
"""

import sys
import timeit
import tracemalloc

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shoal.broker._lean_properties import LeanProperties

N = 20_000


def _us(call: object) -> float:
    return timeit.timeit(call, number=N) / N * 1e6  # type: ignore[arg-type]


def measure(cls: type[Properties]) -> str:
    """One line of figures for ``cls``."""
    sent = cls(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    sent.UserProperty = [("a", "b")]
    sent.ContentType = "x"
    sent.MessageExpiryInterval = 5
    three = bytes(sent.pack())  # type: ignore[no-untyped-call]
    empty = bytes(Properties(PacketTypes.PUBLISH).pack())  # type: ignore[no-untyped-call]
    new_us = _us(lambda: cls(PacketTypes.PUBLISH))  # type: ignore[no-untyped-call]
    three_us = _us(lambda: cls(PacketTypes.PUBLISH).unpack(three))  # type: ignore[no-untyped-call]
    empty_us = _us(lambda: cls(PacketTypes.PUBLISH).unpack(empty))  # type: ignore[no-untyped-call]
    tracemalloc.start()
    kept = [cls(PacketTypes.PUBLISH) for _ in range(1000)]  # type: ignore[no-untyped-call]
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (
        f"{cls.__name__:15s} new {new_us:6.2f} us  unpack(3 props) {three_us:6.2f} us  "
        f"unpack(empty) {empty_us:6.2f} us  {held / len(kept):7.0f} B each\n"
    )


if __name__ == "__main__":
    for kind in (Properties, LeanProperties):
        sys.stdout.write(measure(kind))
