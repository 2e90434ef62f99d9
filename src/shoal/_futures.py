"""Small asyncio helpers shared by every layer; imports nothing of shoal."""

from __future__ import annotations

import asyncio
from typing import Any


def ignore_outcome(future: asyncio.Future[Any]) -> None:
    """A done callback for a future nobody awaits: its failure is retrieved, not logged.

    (asyncio logs "exception was never retrieved" for a failed future no one looked at: a
    QoS 0 publish on a connection that was lost, an announcement failing at stop, a user
    function's late outcome after its time budget ran out.)
    """
    if not future.cancelled():
        future.exception()
