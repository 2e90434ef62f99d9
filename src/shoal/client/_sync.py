"""The synchronous results client (scripts and notebooks): the async client on its own thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Self

import polars as pl

from shoal.broker.settings import BrokerSettings
from shoal.client._async import DEFAULT_BROKER_URL, AsyncResultsClient
from shoal.client._portal import LoopThread
from shoal.client.assemble import DEFAULT_MAX_WAIT_MS


class ResultsClient:
    """Read a pipeline's results from the broker into polars DataFrames.

    The blocking twin of ``AsyncResultsClient`` (same arguments, same methods), usable from
    scripts and from notebooks (whose own event loop it leaves alone: it runs a private one
    on a background thread). Close it, or use it as a context manager::

        with ResultsClient("mqtt://127.0.0.1:1883") as client:
            frame = client.latest("default", n=3)           # polars.DataFrame
            for window in client.windows("default", count=10):
                print(window.select("key", "mean", "p95"))
            per_key = client.latest_per_key("default")

    For pandas, ``frame.to_pandas()`` (needs pyarrow) or ``shoal.client.to_pandas(frame)``.
    """

    def __init__(
        self,
        broker: BrokerSettings | str = DEFAULT_BROKER_URL,
        *,
        topic_root: str = "",
        discovery_timeout_s: float = 3.0,
        assemble_wait_s: float = DEFAULT_MAX_WAIT_MS / 1000,
    ) -> None:
        self.aio = AsyncResultsClient(
            broker,
            topic_root=topic_root,
            discovery_timeout_s=discovery_timeout_s,
            assemble_wait_s=assemble_wait_s,
        )
        self._portal = LoopThread()

    @property
    def settings(self) -> BrokerSettings:
        """Where the broker is."""
        return self.aio.settings

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        self._portal.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def check(self) -> None:
        """Raise ``BrokerUnreachableError`` unless the broker accepts a connection."""
        self._portal.run(self.aio.check())

    def pipelines(self, wait_s: float = 1.5) -> list[str]:
        """Pipelines seen on the broker (see ``AsyncResultsClient.pipelines``)."""
        return self._portal.run(self.aio.pipelines(wait_s))

    def windows(
        self,
        pipeline: str,
        *,
        window: str | None = None,
        count: int | None = None,
        duration_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> Iterator[pl.DataFrame]:
        """One frame per closed window, live (see ``AsyncResultsClient.windows``)."""
        return self._portal.iterate(
            self.aio.windows(
                pipeline,
                window=window,
                count=count,
                duration_s=duration_s,
                idle_timeout_s=idle_timeout_s,
            )
        )

    def latest(
        self,
        pipeline: str,
        n: int = 1,
        *,
        window: str | None = None,
        timeout_s: float = 60.0,
        archive: Path | None = None,
    ) -> pl.DataFrame:
        """The latest ``n`` windows as one frame (see ``AsyncResultsClient.latest``)."""
        return self._portal.run(
            self.aio.latest(pipeline, n, window=window, timeout_s=timeout_s, archive=archive)
        )

    def latest_per_key(
        self, pipeline: str, *, timeout_s: float = 5.0, quiet_s: float = 0.3
    ) -> pl.DataFrame:
        """The retained latest result per key (see ``AsyncResultsClient.latest_per_key``)."""
        return self._portal.run(
            self.aio.latest_per_key(pipeline, timeout_s=timeout_s, quiet_s=quiet_s)
        )
