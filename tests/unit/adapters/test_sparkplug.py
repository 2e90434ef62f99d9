"""The Sparkplug B state machine: births, aliases, deaths, seq gaps, rebirth requests."""

from __future__ import annotations

import pytest

from shoal.adapters import parse_mapping
from shoal.adapters._proto import sparkplug_b_pb2 as pb
from shoal.adapters.sparkplug import REBIRTH_METRIC, SparkplugDecoder
from shoal.errors import InputError
from shoal.loadtest.sparkplug_encode import device_message, node_birth, node_death

NS = "spBv1.0"
NOW = 1_700_000_000_000


def _decoder(**route: object) -> SparkplugDecoder:
    mapping = parse_mapping({"routes": [{"topic": NS, "format": "sparkplug", **route}]})
    return SparkplugDecoder(mapping.routes[0], max_future_ms=None)


def _feed(decoder: SparkplugDecoder, topic: str, payload: bytes) -> list[tuple]:
    found = parse_mapping({"routes": [{"topic": NS, "format": "sparkplug"}]}).route_for(topic)
    assert found is not None
    return decoder.decode(topic, found[1], payload, NOW)


def _rebirths(decoder: SparkplugDecoder) -> list[str]:
    topics = []
    for topic, payload in decoder.take_commands():
        command = pb.Payload.FromString(payload)
        assert [(m.name, m.datatype, m.boolean_value) for m in command.metrics] == [
            (REBIRTH_METRIC, pb.Boolean, True)
        ]
        topics.append(topic)
    return topics


def test_birth_data_by_alias_death_and_data_before_birth() -> None:
    d = _decoder()
    assert _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 0, bd_seq=3)) == []  # no readings
    born = _feed(d, f"{NS}/g/DBIRTH/n1/dev0", device_message(0, NOW, 1, 21.5, 40, birth=True))
    assert born == [
        ("g.n1.dev0", NOW, 21.5, "temp", None, None),
        ("g.n1.dev0", NOW, 40.0, "hum", None, None),
    ]
    data = _feed(d, f"{NS}/g/DDATA/n1/dev0", device_message(0, NOW + 1, 2, 22.0, -5, birth=False))
    assert [(r[2], r[3]) for r in data] == [(22.0, "temp"), (-5.0, "hum")]  # Int32 sign kept
    assert d.node_state("g", "n1") == (True, 2)
    assert _rebirths(d) == []
    # a stale NDEATH (the will of an older connection) does not kill the current birth
    _feed(d, f"{NS}/g/NDEATH/n1", node_death(NOW, bd_seq=2))
    assert d.node_state("g", "n1")[0]
    assert d.sparkplug.stale_deaths == 1
    _feed(d, f"{NS}/g/NDEATH/n1", node_death(NOW, bd_seq=3))
    assert d.node_state("g", "n1") == (False, None)
    with pytest.raises(InputError) as caught:
        _feed(d, f"{NS}/g/DDATA/n1/dev0", device_message(0, NOW, 3, 1.0, 1, birth=False))
    assert caught.value.reason == "data_before_birth"
    assert _rebirths(d) == [f"{NS}/g/NCMD/n1"]


def test_seq_gap_requests_rebirth_once_and_keeps_the_data() -> None:
    d = _decoder()
    _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 0, 0))
    _feed(d, f"{NS}/g/DBIRTH/n1/dev0", device_message(0, NOW, 1, 1.0, 1, birth=True))
    rows = _feed(d, f"{NS}/g/DDATA/n1/dev0", device_message(0, NOW, 5, 2.0, 2, birth=False))
    assert len(rows) == 2
    assert d.sparkplug.seq_gaps == 1
    assert _rebirths(d) == [f"{NS}/g/NCMD/n1"]
    _feed(d, f"{NS}/g/DDATA/n1/dev0", device_message(0, NOW, 9, 2.0, 2, birth=False))
    assert d.sparkplug.seq_gaps == 2
    assert _rebirths(d) == []  # asked a moment ago: not again yet
    # seq wraps from 255 to 0 without a gap
    _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 254, 1))
    _feed(d, f"{NS}/g/DBIRTH/n1/dev0", device_message(0, NOW, 255, 1.0, 1, birth=True))
    _feed(d, f"{NS}/g/DDATA/n1/dev0", device_message(0, NOW, 0, 1.0, 1, birth=False))
    assert d.sparkplug.seq_gaps == 2


def test_unknown_alias_strings_and_garbage_are_refused_with_reasons() -> None:
    d = _decoder()
    _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 0, 0))
    _feed(d, f"{NS}/g/DBIRTH/n1/dev0", device_message(0, NOW, 1, 1.0, 1, birth=True))
    with pytest.raises(InputError) as caught:
        _feed(d, f"{NS}/g/DDATA/n1/dev0", device_message(7, NOW, 2, 1.0, 1, birth=False))
    assert caught.value.reason == "unknown_alias"
    assert caught.value.field == "metrics[0]"
    text = pb.Payload(timestamp=NOW, seq=3)
    m = text.metrics.add(name="state", datatype=pb.String, string_value="running")
    m = text.metrics.add(name="rpm", datatype=pb.UInt32, int_value=1200)
    assert m.int_value == 1200
    rows = _feed(d, f"{NS}/g/NDATA/n1", text.SerializeToString())
    assert [(r[0], r[2], r[3]) for r in rows] == [("g.n1.node", 1200.0, "rpm")]
    refusals = d.take_refusals()
    assert [(e.reason, e.field) for e in refusals] == [("string_metric", "state")]
    with pytest.raises(InputError) as caught:
        _feed(d, f"{NS}/g/NDATA/n1", b"\xff\xff\xff")
    assert caught.value.reason == "not_sparkplug"
    with pytest.raises(InputError) as caught:
        _feed(d, f"{NS}/g/NCOFFEE/n1", b"")
    assert caught.value.reason == "bad_topic"


def test_strings_skipped_when_the_route_says_so() -> None:
    d = _decoder(strings="skip")
    _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 0, 0))
    text = pb.Payload(timestamp=NOW, seq=1)
    text.metrics.add(name="state", datatype=pb.String, string_value="running")
    assert _feed(d, f"{NS}/g/NDATA/n1", text.SerializeToString()) == []
    assert d.take_refusals() == []


@pytest.mark.parametrize(
    "topic",
    [
        f"{NS}/g/DBIRTH/n1",  # a device message without its device
        f"{NS}/g/DDATA/n1",
        f"{NS}/g/DDEATH/n1",
        f"{NS}/g/NDATA/n1/dev0",  # a node message with one
        f"{NS}/g/DBIRTH/n1/",  # an empty level
        f"{NS}//NBIRTH/n1",
    ],
)
def test_topics_that_do_not_name_what_the_message_type_needs_are_refused(topic: str) -> None:
    d = _decoder()
    _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 0, 0))
    found = parse_mapping({"routes": [{"topic": NS, "format": "sparkplug"}]}).route_for(topic)
    levels = found[1] if found is not None else {}
    with pytest.raises(InputError) as caught:
        d.decode(topic, levels, device_message(0, NOW, 1, 1.0, 1, birth=True), NOW)
    assert caught.value.reason == "bad_topic"
    assert "<node>/<device>" in str(caught.value)


def test_a_metric_with_neither_name_nor_alias_is_not_alias_zero() -> None:
    d = _decoder()
    _feed(d, f"{NS}/g/NBIRTH/n1", node_birth(NOW, 0, 0))
    birth = pb.Payload(timestamp=NOW, seq=1)
    birth.metrics.add(name="temp", alias=0, datatype=pb.Double, double_value=1.5)
    assert _feed(d, f"{NS}/g/DBIRTH/n1/dev0", birth.SerializeToString())[0][2] == 1.5
    by_alias = pb.Payload(timestamp=NOW, seq=2)
    by_alias.metrics.add(alias=0, double_value=2.5)
    assert [r[2:4] for r in _feed(d, f"{NS}/g/DDATA/n1/dev0", by_alias.SerializeToString())] == [
        (2.5, "temp")
    ]
    anonymous = pb.Payload(timestamp=NOW, seq=3)
    anonymous.metrics.add(double_value=3.5)
    with pytest.raises(InputError) as caught:
        _feed(d, f"{NS}/g/DDATA/n1/dev0", anonymous.SerializeToString())
    assert caught.value.reason == "unknown_alias"
