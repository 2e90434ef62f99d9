"""Session window messages: every result carries its own end, and readers keep it."""

from __future__ import annotations

from pathlib import Path

import orjson

from shoal.schemas.results import parse_window_message

GOLDEN = Path(__file__).resolve().parents[3] / "schemas" / "golden" / "outputs"


def test_each_session_keeps_its_own_end_in_every_encoding() -> None:
    for name, content_type in (
        ("result-window-session.json", "application/json"),
        ("result-window-columnar-session.msgpack", "application/msgpack"),
    ):
        message = parse_window_message((GOLDEN / name).read_bytes(), content_type)
        frame = message.frame.sort("key")
        assert frame["key"].to_list() == ["t1", "t2"]
        assert (frame["end"] - frame["start"]).to_list() == [8_000, 7_000]
        assert message.end == frame["end"].max()


def test_the_per_key_message_carries_the_session_end() -> None:
    body = orjson.loads((GOLDEN / "result-key-session.json").read_bytes())
    assert body["end"] - body["start"] == 8_000
