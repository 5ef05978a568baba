"""Single flight: concurrent callers of one key share one call.

The first caller starts the call as a task of its own; the others await that task. Shielded:
a caller that goes away (a client disconnect cancels its request) does not cancel the call for
the others. The key is free again once the call ends, so the next caller starts afresh. Used
where a cold burst of one scope would otherwise repeat the same expensive step per request
(the resolve's DB read, the acquire's dozen Redis round trips).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

from agent_runtime import admission

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class SingleFlight(Generic[K, T]):
    def __init__(self) -> None:
        self._running: dict[K, asyncio.Future[T]] = {}

    async def run(self, key: K, start: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The result (or the exception) of the call running for ``key``; ``start`` makes
        the call when none is running."""
        running = self._running.get(key)
        if running is None:
            running = asyncio.ensure_future(start())
            self._running[key] = running
            running.add_done_callback(lambda done: self._ended(key, done))
            return await asyncio.shield(running)  # the starter's place counts the call's work
        with admission.parked():  # the others only wait for it: their places go to others
            return await asyncio.shield(running)

    def _ended(self, key: K, done: asyncio.Future[T]) -> None:
        if self._running.get(key) is done:
            del self._running[key]
        if not done.cancelled():
            done.exception()  # retrieved: every caller may have gone away
