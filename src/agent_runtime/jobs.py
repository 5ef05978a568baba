"""One periodic runner for every background job, with a leader lock per job across replicas.

Each job has a Redis lock ``agent_runtime:job:{name}`` (token-owned, NX, TTL 2 × interval).
The replica holding it refreshes it every tick and runs the tick; the others try to take it
every tick, so a dead leader is replaced within one TTL. Hazard: a tick that outlives its lock
could overlap a new leader's tick, so every tick is cut off by a timeout shorter than the TTL
and checks ownership first. A failing tick is logged and the loop goes on; stop() ends the
loops and gives the locks back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from agent_runtime import logs
from agent_runtime.tracing import Tracing

log = logging.getLogger(__name__)

T = TypeVar("T")

JOB_LOCK_PREFIX = "agent_runtime:job:"
MIN_LOCK_TTL = 2.0


@dataclass
class Job:
    name: str
    interval: float
    tick: Callable[[], Awaitable[object]]
    runs: int = field(default=0, init=False)
    failures: int = field(default=0, init=False)
    last_success: float | None = field(default=None, init=False)  # wall clock (metrics)
    leading: bool = field(default=False, init=False)  # this replica held the lock last tick
    seconds: float = field(default=0.0, init=False)  # total time spent in ticks

    @property
    def lock_ttl(self) -> float:
        return max(2 * self.interval, MIN_LOCK_TTL)

    @property
    def tick_timeout(self) -> float:
        # ends well before the lock could lapse, so two leaders never tick at once
        return self.lock_ttl * 0.75


class JobRunner:
    def __init__(self, *, redis: Redis, jobs: list[Job], tracing: Tracing | None = None) -> None:
        """``tracing``: a span per tick (off unless given)."""
        self._redis = redis
        self._tracing = tracing or Tracing()
        self.jobs = {job.name: job for job in jobs}
        self._locks = {
            job.name: Lock(
                redis, JOB_LOCK_PREFIX + job.name, timeout=job.lock_ttl, thread_local=False
            )
            for job in jobs
        }
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for job in self.jobs.values():
            self._tasks.append(asyncio.create_task(self._loop(job), name=f"job:{job.name}"))

    @property
    def running(self) -> bool:
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for job in self.jobs.values():
            job.leading = False
        for lock in self._locks.values():
            with contextlib.suppress(Exception):  # not ours any more, or Redis is gone
                await lock.release()

    async def is_leader(self, name: str) -> bool:
        return bool(await self._locks[name].owned())

    async def run_once(self, name: str) -> bool:
        """One tick of ``name`` if this replica leads it; returns whether it ran."""
        job, lock = self.jobs[name], self._locks[name]
        job.leading = await self._lead(lock)
        if not job.leading:
            return False
        job.runs += 1
        started = time.perf_counter()
        try:
            # one span per tick: its Kubernetes calls (and deploys) are its children
            with (
                self._tracing.span(f"job {name}", attributes={"agent_runtime.job": name}),
                logs.bound(job=name),
            ):
                await asyncio.wait_for(job.tick(), timeout=job.tick_timeout)
        except Exception:
            job.failures += 1
            log.exception("job %s: tick failed", name)
        else:
            job.last_success = time.time()
        finally:
            job.seconds += time.perf_counter() - started
        return True

    async def _lead(self, lock: Lock) -> bool:
        try:
            if await lock.owned():
                await lock.reacquire()  # refresh the TTL: leadership stays put while alive
                return True
            return bool(await lock.acquire(blocking=False))
        except LockError:
            return False  # lapsed between the check and the refresh: somebody else leads

    async def _loop(self, job: Job) -> None:
        while not self._stop.is_set():
            started = asyncio.get_running_loop().time()
            try:
                await self.run_once(job.name)
            except Exception:  # Redis down: try again next tick
                log.warning("job %s: could not take its lock", job.name, exc_info=True)
            elapsed = asyncio.get_running_loop().time() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(job.interval - elapsed, 0.01))


class BackgroundTasks:
    """Tasks nobody awaits at once (a warm deploy, an idle notice, a detached deploy) but that
    shutdown must let finish: kept referenced while they run, awaited by ``wait()``."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: whoever waited for it may be gone (its deadline)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class DetachedWrites(Generic[T]):
    """Writes done after the reply, in order: one detached task (started when the first write
    comes, gone when none is left) takes the pending ones in batches of at most ``batch`` and
    hands each batch to ``write``, within ``timeout`` seconds; a batch that fails or runs out of
    time is logged and counted ``failed`` (not retried: what it writes must be rewritten by its
    owner later). At most ``pending`` wait: a ``put`` beyond it waits for room (the caller pays
    about one batch's round trip; the order stays) up to ``timeout``, then the write is dropped,
    counted ``dropped`` and logged. ``drain()`` (shutdown) writes what is pending; a ``put``
    after it writes its own at once (``inline``). ``counted(outcome, n)``: ``written``,
    ``failed``, ``waited`` (a put that waited for room), ``dropped``, ``inline``."""

    def __init__(
        self,
        write: Callable[[list[T]], Awaitable[object]],
        *,
        name: str,
        pending: int,
        batch: int,
        timeout: float,
        counted: Callable[[str, int], None] | None = None,
    ) -> None:
        self._write = write
        self._name = name
        self._bound = pending
        self._batch = batch
        self._timeout = timeout
        self._counted = counted or (lambda outcome, n: None)
        self._queue: collections.deque[T] = collections.deque()
        self._room = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._queue)

    async def put(self, item: T) -> None:
        if self._closed:
            await self._write_now([item], "inline")
            return
        if len(self._queue) >= self._bound:
            self._counted("waited", 1)
            try:
                async with asyncio.timeout(self._timeout):
                    while len(self._queue) >= self._bound:
                        self._room.clear()
                        await self._room.wait()
            except TimeoutError:
                self._counted("dropped", 1)
                log.warning("%s: %d writes pending for %.1f s: one dropped", self._name,
                            len(self._queue), self._timeout)  # fmt: skip
                return
            if self._closed:
                await self._write_now([item], "inline")
                return
        self._queue.append(item)
        if self._worker is None:
            # the request's log fields are not the batch's
            self._worker = logs.detached_task(self._run(), name=f"detached-writes:{self._name}")

    async def _run(self) -> None:
        try:
            while self._queue:
                n = min(len(self._queue), self._batch)
                batch = [self._queue.popleft() for _ in range(n)]
                self._room.set()
                await self._write_now(batch, "written")
        finally:
            self._worker = None
            self._room.set()

    async def _write_now(self, batch: list[T], outcome: str) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._write(batch)
        except Exception as exc:
            self._counted("failed", len(batch))
            log.warning("%s: %d writes failed: %s: %s", self._name, len(batch),
                        type(exc).__name__, exc)  # fmt: skip
        else:
            self._counted(outcome, len(batch))

    async def flush(self) -> None:
        """Wait until every write put so far was tried (bounded: each batch by ``timeout``)."""
        while self._worker is not None:
            await asyncio.shield(self._worker)

    async def drain(self) -> None:
        """Shutdown: no more detached writes; the pending ones are written first."""
        self._closed = True
        self._room.set()
        await self.flush()
