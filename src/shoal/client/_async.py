"""The asyncio results client: live windows, the latest N windows, the latest value per key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Final

import polars as pl

from shoal.broker import default_session_factory
from shoal.broker.session import Session, SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.client._watch import Watch, messages_with_ticks
from shoal.client.assemble import DEFAULT_MAX_WAIT_MS, AssembledWindow, WindowAssembler
from shoal.client.errors import BrokerUnreachableError, ResultsTimeoutError
from shoal.client.messages import key_records_frame
from shoal.clock import Clock, SystemClock
from shoal.errors import BrokerError, UsageError
from shoal.schemas.results import empty_results
from shoal.schemas.topics import Topics

log = logging.getLogger(__name__)

DEFAULT_BROKER_URL: Final = "mqtt://127.0.0.1:1883"
_TICK_S: Final = 0.1


class AsyncResultsClient:
    """Read a pipeline's results from the broker, as polars DataFrames (asyncio API).

    Every frame has the result layout of ``shoal.schemas.results`` (one row per key and
    window). Each call opens its own MQTT session and closes it when done, so calls are
    independent and the client holds no connection between them.

    Args:
        broker: ``BrokerSettings`` (the same as every other shoal component) or a URL.
        topic_root: the deployment's topic root (``--topic-root``), if any.
        discovery_timeout_s: how long to look for signs of a pipeline (a combiner heartbeat,
            a retained confirmation or a result) before raising ``NoSuchPipelineError``.
        assemble_wait_s: how long a window of a partitioned pipeline waits for its other
            partitions before it is delivered with what arrived.
        clock: time source (tests inject one).
        session_factory: opens the MQTT sessions (default: ``default_session_factory()``).
    """

    def __init__(
        self,
        broker: BrokerSettings | str = DEFAULT_BROKER_URL,
        *,
        topic_root: str = "",
        discovery_timeout_s: float = 3.0,
        assemble_wait_s: float = DEFAULT_MAX_WAIT_MS / 1000,
        clock: Clock | None = None,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.settings = BrokerSettings.from_url(broker) if isinstance(broker, str) else broker
        self._connect = session_factory or default_session_factory()
        self.topics = Topics(root=topic_root)
        self.discovery_timeout_s = discovery_timeout_s
        self.assemble_wait_s = assemble_wait_s
        self.clock = clock or SystemClock()

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Session]:
        session = self._connect(self.settings, unique_client_id("shoal-client"))
        try:
            await session.__aenter__()
        except BrokerError as exc:
            raise BrokerUnreachableError(
                f"cannot reach an MQTT broker at {self.settings.url}: {exc.__cause__ or exc}. "
                "Is it running, and are the address, credentials and TLS settings right?"
            ) from exc
        try:
            yield session
        finally:
            await session.__aexit__(None, None, None)

    async def check(self) -> None:
        """Connect once and disconnect: raises ``BrokerUnreachableError`` if that fails."""
        async with self._session():
            pass

    async def pipelines(self, wait_s: float = 1.5) -> list[str]:
        """Names of pipelines with running combiners or retained confirmations on the broker."""
        async with self._session() as session:
            watch = Watch(session, self.topics, "-", WindowAssembler(), clock=self.clock)
            await watch.subscribe()
            deadline = self.clock.monotonic() + wait_s
            async for message in messages_with_ticks(session, _TICK_S):
                if message is not None:
                    watch.on_message(message, self.clock.now_ms())
                if self.clock.monotonic() >= deadline:
                    break
            return sorted(watch.known)

    async def windows(
        self,
        pipeline: str,
        *,
        window: str | None = None,
        count: int | None = None,
        duration_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> AsyncGenerator[pl.DataFrame, None]:
        """Yield one frame per closed window as the pipeline emits it (live, from now on).

        Partitions of a window are assembled into one frame; re-published windows are
        dropped. Ends after ``count`` windows or ``duration_s`` seconds (either may be None:
        no limit).

        Args:
            pipeline: the pipeline's name.
            window: only windows with this name (a pipeline may compute several).
            count: stop after this many windows.
            duration_s: stop after this long.
            idle_timeout_s: raise ``ResultsTimeoutError`` if no window arrives for this long.

        Raises:
            NoSuchPipelineError: nothing on the broker names the pipeline.
            BrokerUnreachableError: the broker cannot be reached.
            ResultsTimeoutError: ``idle_timeout_s`` passed without a window.
            BrokerError: the connection was lost.
        """
        stream = self._assembled(
            pipeline, window=window, count=count, duration_s=duration_s, idle_s=idle_timeout_s
        )
        async with contextlib.aclosing(stream):
            async for assembled in stream:
                yield assembled.frame

    async def _assembled(
        self,
        pipeline: str,
        *,
        window: str | None,
        count: int | None,
        duration_s: float | None,
        idle_s: float | None,
    ) -> AsyncGenerator[AssembledWindow, None]:
        assembler = WindowAssembler(max_wait_ms=int(self.assemble_wait_s * 1000))
        started = last = self.clock.monotonic()
        seen = 0
        async with self._session() as session:
            watch = Watch(session, self.topics, pipeline, assembler, clock=self.clock)
            await watch.subscribe()
            async for message in messages_with_ticks(session, _TICK_S):
                now = self.clock.monotonic()
                now_ms = self.clock.now_ms()
                ready = (
                    assembler.expire(now_ms)
                    if message is None
                    else watch.on_message(message, now_ms)
                )
                for item in ready:
                    if window is not None and item.window != window:
                        continue
                    if not item.complete:
                        log.warning(
                            "window %s@%d of %s delivered with partitions %s only",
                            item.window,
                            item.start,
                            pipeline,
                            item.partitions_seen,
                        )
                    yield item
                    seen += 1
                    last = self.clock.monotonic()
                    if count is not None and seen >= count:
                        return
                self._check_exists(watch, now - started)
                await watch.discovered()
                if duration_s is not None and now - started >= duration_s:
                    return
                if idle_s is not None and now - last >= idle_s:
                    raise ResultsTimeoutError(
                        f"no window result from pipeline {pipeline!r} on {self.settings.url} "
                        f"for {idle_s:g} s: is it receiving data?",
                        pipeline=pipeline,
                        wanted=count or seen + 1,
                        got=seen,
                    )

    def _check_exists(self, watch: Watch, elapsed_s: float) -> None:
        if watch.exists or not watch.can_discover or elapsed_s < self.discovery_timeout_s:
            return
        raise watch.missing(self.settings.url, self.discovery_timeout_s)

    async def latest(
        self,
        pipeline: str,
        n: int = 1,
        *,
        window: str | None = None,
        timeout_s: float = 60.0,
        archive: Path | None = None,
    ) -> pl.DataFrame:
        """The latest ``n`` windows of a pipeline as one frame, sorted by end, window and key.

        Window messages are not retained by the broker, so without ``archive`` this waits
        for the next ``n`` windows to close. With ``archive`` (a ``shoal archive`` folder),
        the newest archived windows come first and only the shortfall is awaited live.

        Raises:
            NoSuchPipelineError: nothing on the broker names the pipeline.
            BrokerUnreachableError: the broker cannot be reached.
            ResultsTimeoutError: fewer than ``n`` windows within ``timeout_s``.
        """
        if n < 1:
            raise UsageError(f"n must be at least 1, not {n}")
        frames: dict[tuple[str, int], pl.DataFrame] = {}
        if archive is not None:
            frames.update(_archived_windows(archive, pipeline, window, n))
        if len(frames) >= n:
            return _last(frames, n)
        started = self.clock.monotonic()
        try:
            async with (
                asyncio.timeout(timeout_s),
                contextlib.aclosing(
                    self._assembled(
                        pipeline, window=window, count=None, duration_s=None, idle_s=None
                    )
                ) as stream,
            ):
                async for item in stream:
                    frames[(item.window, item.start)] = item.frame
                    if len(frames) >= n:
                        return _last(frames, n)
        except TimeoutError as exc:
            raise ResultsTimeoutError(
                f"only {len(frames)} of {n} windows of pipeline {pipeline!r} arrived within "
                f"{timeout_s:g} s (windows close when the watermark passes their end; "
                "raise timeout_s, ask for fewer, or pass archive=)",
                pipeline=pipeline,
                wanted=n,
                got=len(frames),
            ) from exc
        elapsed = self.clock.monotonic() - started
        raise ResultsTimeoutError(
            f"the result stream of {pipeline!r} ended after {elapsed:.1f} s",
            pipeline=pipeline,
            wanted=n,
            got=len(frames),
        )

    async def latest_per_key(
        self, pipeline: str, *, timeout_s: float = 5.0, quiet_s: float = 0.3
    ) -> pl.DataFrame:
        """The retained latest result of every key (``results/<pipeline>/<key>``).

        The broker sends retained messages right after subscribing; this returns once none
        has arrived for ``quiet_s`` (or at ``timeout_s``). The frame has ``pipeline``,
        ``window``, ``start``, ``end``, ``revision``, ``emitted_at``, ``key`` and the result
        fields, one row per key, sorted by key; it is empty if the pipeline exists but
        publishes no per-key results.

        Raises:
            NoSuchPipelineError: nothing on the broker names the pipeline.
            BrokerUnreachableError: the broker cannot be reached.
        """
        async with self._session() as session:
            watch = Watch(
                session, self.topics, pipeline, WindowAssembler(), per_key=True, clock=self.clock
            )
            await watch.subscribe()
            started = self.clock.monotonic()
            async for message in messages_with_ticks(session, min(_TICK_S, quiet_s)):
                if message is not None:
                    watch.on_message(message, self.clock.now_ms())
                now = self.clock.monotonic()
                if watch.last_retained_at is not None and now - watch.last_retained_at >= quiet_s:
                    break
                if now - started >= timeout_s:
                    break
                if watch.key_records or now - started < self.discovery_timeout_s:
                    continue
                if watch.exists or not watch.can_discover:
                    break  # the pipeline exists but publishes no per-key results
                raise watch.missing(self.settings.url, self.discovery_timeout_s)
        if not watch.key_records and not watch.exists and watch.can_discover:
            raise watch.missing(self.settings.url, self.clock.monotonic() - started)
        return key_records_frame(list(watch.key_records.values()))


def _last(frames: dict[tuple[str, int], pl.DataFrame], n: int) -> pl.DataFrame:
    def order(item: tuple[tuple[str, int], pl.DataFrame]) -> tuple[int, str, int]:
        (name, start), frame = item
        return (int(frame["end"][0]) if frame.height else start, name, start)

    parts = [frame for _, frame in sorted(frames.items(), key=order)[-n:]]
    if not parts:
        return empty_results()
    return pl.concat(parts, how="diagonal_relaxed").sort("end", "window", "key", nulls_last=True)


def _archived_windows(
    archive: Path, pipeline: str, window: str | None, n: int
) -> dict[tuple[str, int], pl.DataFrame]:
    from shoal.archive.read import read_results  # noqa: PLC0415 - the archive is optional

    frame = read_results(archive, pipeline)
    if window is not None:
        frame = frame.filter(pl.col("window") == window)
    if frame.height == 0:
        return {}
    last = frame.select("window", "start", "end").unique().sort("end", "window", "start").tail(n)
    picked = frame.join(last.select("window", "start"), on=["window", "start"], how="semi")
    return {
        (str(name), int(start)): part.sort("key", nulls_last=True)
        for (name, start), part in picked.group_by("window", "start", maintain_order=True)
    }
