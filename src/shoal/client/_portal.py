"""An asyncio loop on a background thread, so synchronous code can call the async client.

Notebooks already run an event loop in the kernel's thread (``asyncio.run`` fails there), and
scripts have none; a private loop on a daemon thread serves both the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines and async iterators on one private event loop thread."""

    def __init__(self, name: str = "shoal-client") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # Finish what close() left behind (cancelled tasks' cleanup) before closing.
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return not self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the loop and wait for its result (exceptions propagate).

        A KeyboardInterrupt while waiting cancels the coroutine.
        """
        if self.closed:
            coro.close()
            raise RuntimeError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError, Exception):
                future.result(timeout=5)
            raise

    def iterate(self, iterator: AsyncIterator[T]) -> Iterator[T]:
        """A synchronous iterator over an async one; closing it closes the async one."""
        try:
            while True:
                try:
                    item = self.run(_next(iterator))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None and not self.closed:
                with contextlib.suppress(Exception):
                    self.run(close())

    def close(self) -> None:
        """Stop the loop and join the thread (idempotent)."""
        if self.closed:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _next(iterator: AsyncIterator[T]) -> T:
    return await iterator.__anext__()
