"""Which pipelines a worker serves, and which of their handlers a delivery goes to.

A worker holds one ``Routes``: ``PinnedRoutes`` for ``shoal worker --pipeline FILE`` (one
pipeline, fixed) or ``shoal.runtime.pool.PoolRoutes`` (every deployed pipeline, followed
at run time). The worker's loop, acker, heartbeat and drain are the same for both.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from shoal.broker.session import Message, Session
from shoal.runtime._batches import BatchHandler


class Routes(Protocol):
    """What a worker asks of the pipelines it serves."""

    async def join(self, session: Session) -> None:
        """Subscribe to everything served (on every connect: ``$share`` is not restored)."""

    async def leave(self, session: Session) -> None:
        """Unsubscribe from every input (draining: the broker routes nothing new to us)."""

    async def route(
        self, session: Session, message: Message, out: Session
    ) -> list[asyncio.Future[None]]:
        """Handle one delivery; the PUBACK futures (on ``out``) to wait for before acking it.

        ``session`` is the worker's input (subscriptions); outputs are published on ``out``.
        """

    def marker_back(self, token: str) -> bool:
        """A marker the routes sent to the worker's control topic came back (True: theirs)."""

    def describe(self) -> dict[str, object]:
        """Heartbeat keys: ``pipeline`` and, for a pool, ``serving``."""


class PinnedRoutes:
    """One pipeline, fixed at start (``shoal worker --pipeline FILE``)."""

    def __init__(self, handler: BatchHandler) -> None:
        self.handler = handler

    async def join(self, session: Session) -> None:
        """Join the pipeline's shared subscription."""
        await session.subscribe(self.handler.filters, qos=1)

    async def leave(self, session: Session) -> None:
        """Leave it."""
        await session.unsubscribe(self.handler.filters)

    async def route(
        self,
        session: Session,  # noqa: ARG002 - subscribes nothing at run time
        message: Message,
        out: Session,
    ) -> list[asyncio.Future[None]]:
        """Every delivery is the pipeline's."""
        return self.handler.handle(out, message)

    def marker_back(self, token: str) -> bool:  # noqa: ARG002 - sends no markers of its own
        """None are ours."""
        return False

    def describe(self) -> dict[str, object]:
        """The pipeline's name."""
        return {"pipeline": self.handler.spec.name}
