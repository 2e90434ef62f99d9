"""Hostile device payloads through the adapter's decoders: no crash, every refusal specific.

The 10^5-per-format run is ``shoal bench adapt --fuzz 100000`` (and the slow test below)."""

from __future__ import annotations

import pytest

from shoal.loadtest.fuzz_devices import FUZZ_KINDS, fuzz


@pytest.mark.parametrize("kind", FUZZ_KINDS)
def test_fuzzed_payloads_never_crash_the_decoder(kind: str) -> None:
    report = fuzz(kind, 4_000, seed=11)
    assert report.crashes == []
    assert report.payloads == 4_000
    assert sum(report.refused.values()) > 1_000  # it does reach the refusals
    assert len(report.refused) >= 4  # and many different ones
    assert report.accepted > 0  # and some fuzz is valid


@pytest.mark.slow
@pytest.mark.parametrize("kind", FUZZ_KINDS)
def test_hundred_thousand_payloads_per_format(kind: str) -> None:
    report = fuzz(kind, 100_000, seed=1)
    assert report.crashes == []
