"""``shoal simulate``'s exit code stands on delivery, not on how fast the broker accepted it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shoal._cli.simulate import exit_code


@pytest.mark.parametrize(
    ("report", "code"),
    [
        # Re-sends after a broker restart ran 5% above the offered rate: nothing lost.
        ({"achieved_ratio": 1.05, "delivered": True, "stopped_early": False}, 0),
        # Behind the offered rate but everything arrived and was confirmed.
        ({"achieved_ratio": 0.90, "delivered": True, "stopped_early": False}, 0),
        # Exactly on rate, but a batch was never accepted or never confirmed.
        ({"achieved_ratio": 1.00, "delivered": False, "stopped_early": False}, 1),
        # Stopped by the user (Ctrl-C): what it did is reported, not failed.
        ({"achieved_ratio": 0.50, "delivered": False, "stopped_early": True}, 0),
    ],
)
def test_the_exit_code_follows_delivery(report: dict[str, object], code: int) -> None:
    assert exit_code(SimpleNamespace(**report)) == code
