"""A window result larger than the broker's packet limit is published in parts, not retried.

Mosquitto here accepts packets of at most 64 KiB; windows of a few thousand keys encode to
several times that. Every key's result must arrive exactly once and equal the oracle, and the
combiner must keep confirming its gateways (before the fix it reconnected and retried the
refused message forever).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import polars as pl
import pytest

from shoal.broker.embedded import EmbeddedBroker
from shoal.schemas import Encoding
from shoal.schemas.topics import Topics
from tests.support.datasets import make_batches, two_window_spec
from tests.support.live import run_against_oracle

pytestmark = pytest.mark.broker

MAX_PACKET = 65_536


def test_large_windows_arrive_in_parts_exactly_once(tmp_path: Path) -> None:
    spec = two_window_spec(
        "parts",
        ["count", "mean", "max", "p50"],
        checkpoint_interval_ms=200,
        output_encodings=["json", "msgpack"],
    )
    batches = make_batches(
        seed=11,
        gateways=3,
        batches_per_gateway=14,
        rows_per_batch=(120, 250),
        keys=3_000,
        late_fraction=0.0,
    )
    topics = Topics(root="parts")
    with EmbeddedBroker(
        "dev", data_dir=tmp_path / "broker", overrides={"max_packet_size": str(MAX_PACKET)}
    ) as broker:

        async def scenario() -> None:
            run = await run_against_oracle(
                spec,
                batches,
                list(range(len(batches))),
                settings=broker.settings,
                topics=topics,
                workers=2,
                state_dir=tmp_path / "state",
                encoding=Encoding.BINARY_COLUMNAR,
            )
            windows = run.seen.windows
            split = [w for w in windows if w.get("parts", 1) > 1]
            assert split, "no window was large enough to be split: the test proves nothing"
            for message in split:
                assert 0 <= message["part"] < message["parts"]
                assert message["keys"] == len(message["results"])
            # every part of every split window arrived, once
            identities = [
                (w["window"], w["start"], w["partition"], w["revision"], w.get("part", 0))
                for w in windows
            ]
            assert len(identities) == len(set(identities))
            for message in split:
                same = [
                    w
                    for w in split
                    if (w["window"], w["start"]) == (message["window"], message["start"])
                ]
                assert sorted(w["part"] for w in same) == list(range(message["parts"]))
            # every key's result once (the oracle comparison checks the values)
            frame = run.seen.results_frame()
            assert frame.select("window", "start", "key").is_duplicated().sum() == 0
            assert frame.height == frame.select(pl.struct("window", "start", "key")).n_unique()
            # the combiner kept confirming: every gateway's last seq
            last = {b.gateway_id: b.seq for b in batches}
            for gateway_id, seq in last.items():
                assert run.seen.confirms.get((gateway_id, 0)) == seq
            combiner = run.pipeline.combiners[0]
            assert combiner.results_refused == 0
            assert run.seen.deadletters == []

        asyncio.run(scenario())
