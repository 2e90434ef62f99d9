"""paho's MQTT 5 ``Properties`` without the tables it rebuilds in every instance.

paho-mqtt 2.x builds, in every ``Properties.__init__``, the whole MQTT 5 property table: a
list of type names and two dicts of 27 entries each, with a list per entry (about 2.9 KB and
20 us per object, measured). It makes one for every PUBLISH it parses and every CONNECT,
CONNACK, PUBACK or SUBACK it reads or writes, and the tables never change. So a received
message costs more in its ``Properties`` than in its parsing (docs/benchmarks.md: 19.6 of
23.5 us per PUBLISH), and every message waiting in a queue and every connection keeps 2.9 KB
of constants: with 1,000 hosted partitions (2,000 connections) a pool combiner held ~25 MB of
them.

``LeanProperties`` is a ``Properties`` whose tables are class attributes, built once by paho's
own constructor, with a dict for the name lookup paho does by a linear scan. Every method is
paho's (pack, unpack, validation on assignment, ``json``), so what goes on the wire is the
same. ``install`` makes paho's client and packet parser construct it; only ``shoal.broker``
imports paho, and it installs this on import.
"""

from __future__ import annotations

from typing import Any, ClassVar

import paho.mqtt._packet as paho_packet
import paho.mqtt.client as paho_client
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

_TEMPLATE: Any = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]


class LeanProperties(Properties):
    """``Properties`` sharing paho's constant tables instead of copying them per object."""

    types = _TEMPLATE.types
    names = _TEMPLATE.names
    properties = _TEMPLATE.properties
    _idents: ClassVar[dict[str, int]] = {
        name.replace(" ", ""): ident for name, ident in _TEMPLATE.names.items()
    }
    _names_by_ident: ClassVar[dict[int, str]] = {
        ident: name for name, ident in _TEMPLATE.names.items()
    }

    def __init__(self, packetType: int) -> None:  # noqa: N803 (paho's name)
        object.__setattr__(self, "packetType", packetType)

    def getIdentFromName(self, compressedName: str) -> int:  # noqa: N802, N803 (paho's names)
        """The property's identifier, -1 if unknown (paho scans its table for it)."""
        return self._idents.get(compressedName, -1)

    def getNameFromIdent(self, identifier: int) -> str | None:  # noqa: N802 (paho's name)
        """The property's name (with spaces), None if unknown (paho scans its table)."""
        return self._names_by_ident.get(identifier)

    # A property set is an instance attribute, and ``packetType`` is the only other one (the
    # tables are class attributes): paho tests ``hasattr`` for each of the 27 names instead.

    def isEmpty(self) -> bool:  # noqa: N802 (paho's name)
        """Whether no property is set."""
        return self.__dict__.keys() <= {"packetType"}

    def clear(self) -> None:
        """Remove every property set (``unpack`` starts with this)."""
        if len(self.__dict__) > 1:  # a fresh object (every parsed packet) has nothing set
            for name in [n for n in self.__dict__ if n != "packetType"]:
                delattr(self, name)


def install() -> None:
    """Make paho's client and packet parser build ``LeanProperties`` (idempotent)."""
    paho_client.Properties = LeanProperties  # type: ignore[attr-defined]
    paho_packet.Properties = LeanProperties  # type: ignore[attr-defined]
