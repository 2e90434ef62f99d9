"""Sparkplug B edge nodes for simulations and tests, built with the protobuf classes directly.

Independent of the adapter's decoder (``shoal.adapters.sparkplug``): only the generated
message classes are shared, the way any Sparkplug library would share the official schema.
Each node sends an NBIRTH (``bdSeq``, ``Node Control/Rebirth``), a DBIRTH per device that
declares its metrics with aliases and carries step 0's values, then DDATA by alias only.
``seq`` runs 0-255 per node over all of its messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shoal.adapters._proto import sparkplug_b_pb2 as pb

TEMP_ALIAS_BASE = 1
"""Device d's ``temp`` has alias 2d + 1 and its ``hum`` 2d + 2: unique within the node."""


def _metric(payload: pb.Payload, name: str | None, alias: int | None, ts: int) -> pb.Payload.Metric:
    metric = payload.metrics.add()
    if name is not None:
        metric.name = name
    if alias is not None:
        metric.alias = alias
    metric.timestamp = ts
    return metric


def node_birth(ts: int, seq: int, bd_seq: int) -> bytes:
    """An NBIRTH payload: bdSeq and the rebirth control metric."""
    payload = pb.Payload(timestamp=ts, seq=seq)
    bd = _metric(payload, "bdSeq", None, ts)
    bd.datatype = pb.Int64
    bd.long_value = bd_seq
    control = _metric(payload, "Node Control/Rebirth", None, ts)
    control.datatype = pb.Boolean
    control.boolean_value = False
    return payload.SerializeToString()


def node_death(ts: int, bd_seq: int) -> bytes:
    """An NDEATH payload (what a node registers as its will)."""
    payload = pb.Payload(timestamp=ts)
    bd = _metric(payload, "bdSeq", None, ts)
    bd.datatype = pb.Int64
    bd.long_value = bd_seq
    return payload.SerializeToString()


def device_message(
    device: int, ts: int, seq: int, temp: float, hum: float, *, birth: bool
) -> bytes:
    """A DBIRTH (names, aliases, datatypes and values) or a DDATA (aliases and values)."""
    payload = pb.Payload(timestamp=ts, seq=seq)
    alias = 2 * device + TEMP_ALIAS_BASE
    t = _metric(payload, "temp" if birth else None, alias, ts)
    h = _metric(payload, "hum" if birth else None, alias + 1, ts)
    if birth:
        t.datatype = pb.Double
        h.datatype = pb.Int32
    t.double_value = temp
    h.int_value = int(hum) & 0xFFFFFFFF  # Int32 travels as two's complement uint32
    return payload.SerializeToString()


@dataclass(frozen=True, slots=True)
class SparkplugFleet:
    """Sparkplug edge nodes: device d on node d % nodes, values from the given functions.

    Attributes:
        root: the namespace (``spBv1.0``, perhaps under a prefix).
        group: the group id.
        nodes: edge nodes.
        count: devices.
        ts: event time of a step.
        temp, hum: a device's values at a step.
    """

    root: str
    group: str
    nodes: int
    count: int
    ts: Callable[[int], int]
    temp: Callable[[int, int], float]
    hum: Callable[[int, int], float]

    def topic(self, kind: str, node: int, device: int | None = None) -> str:
        """``<namespace>/<group>/<kind>/node<n>[/dev<d>]``."""
        base = f"{self.root}/{self.group}/{kind}/node{node}"
        return base if device is None else f"{base}/dev{device}"

    def messages(self, first_step: int, steps: int) -> Iterator[tuple[str, bytes]]:
        """Births (at step 0) and data for ``steps`` steps from ``first_step``."""
        nodes = min(self.nodes, self.count)
        on_node = [len(range(n, self.count, nodes)) for n in range(nodes)]
        seq = [0] * nodes
        if first_step > 0:  # continue the counters as if every earlier step was sent
            seq = [(1 + on_node[n] * first_step) % 256 for n in range(nodes)]
        for step in range(first_step, first_step + steps):
            ts = self.ts(step)
            if step == 0:
                for n in range(nodes):
                    yield self.topic("NBIRTH", n), node_birth(ts, seq[n], 0)
                    seq[n] = (seq[n] + 1) % 256
            kind = "DBIRTH" if step == 0 else "DDATA"
            for device in range(self.count):
                n = device % nodes
                payload = device_message(
                    device,
                    ts,
                    seq[n],
                    self.temp(device, step),
                    self.hum(device, step),
                    birth=step == 0,
                )
                seq[n] = (seq[n] + 1) % 256
                yield self.topic(kind, n, device), payload
