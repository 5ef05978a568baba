"""Admission at the edge: a bound on the API requests one replica works on at once.

Why: past its capacity a replica without a bound took every arrival in, so the work in flight
grew with the backlog; each request held a Redis connection while the saturated loop got round
to its reply, the pool ran dry ("No connection available" → 503 BACKEND_UNAVAILABLE), eos
touches failed so sessions stayed, scopes filled, routes queued for ``scope_full_timeout`` and
job ticks (which share the pool) failed: a collapse that outlived the overload. With the bound
the excess is answered (503 ``OVERLOADED`` + ``Retry-After``, a fixed answer, no Redis or DB
work) and the admitted requests keep the replica at capacity. A short burst over the bound is
not overload: it waits for places (a bounded stack, newest first) and is served; only a backlog
that has lasted ``burst_wait`` makes newcomers wait milliseconds before they are shed.

What counts: a request under ``/api/session/`` from the moment its body has arrived until its
answer is sent. The body is read before the place is taken (bounded: the body limit here, the
protocol's body deadline in time): a client that drips its body holds a socket, never a place,
so a few slow clients cannot take every place from the fast ones.

A request *parked* (a route in its scope's wait queue, a follower waiting for a
leader's deploy, a leader waiting for Kubernetes) holds no Redis connection for most of its
wait, so it gives its place back while parked (``parked()``) and takes it again, without the
check, when it resumes: waiters never starve fast-path admission, and a woken waiter is never
shed after its wait. ``touch`` (which frees what route took: shedding an eos would keep its
session alive and feed the overload) may use a second bound's worth of places on top.

Hazard: ``parked()`` acts only in the task that was admitted (a background task inherits the
context, not the place).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.errors import ErrorCode

RETRY_AFTER = 1  # seconds: a shed request is retried (ideally on another replica) soon
OVERLOAD_WAIT = 0.005  # seconds a newcomer may wait for a place under overload


@dataclass
class _Ticket:
    admission: Admission
    task: asyncio.Task[object] | None
    held: bool = True


class Admission:
    """The places of one app: ``limit`` requests at work, then a bounded waiting stack.

    A request over the bound waits for a place, newest first (LIFO): in a short burst every
    waiter is served within ``burst_wait``; under sustained overload the newest arrivals are
    served at once (low latency for what is served) and the oldest are shed. When the stack
    has not been empty for ``burst_wait`` the replica is overloaded, not bursting: a newcomer
    then waits at most ``OVERLOAD_WAIT`` and older waiters are shed when a place frees; with
    ``queue`` waiters already there a newcomer is shed at once.
    """

    def __init__(self, limit: int, *, queue: int = 0, burst_wait: float = 0.0) -> None:
        self.limit = limit
        self.queue = queue
        self.burst_wait = burst_wait
        self.active = 0
        self.shed = 0  # requests answered OVERLOADED since start
        self.parked_now = 0
        self.waiting = 0
        self._stack: list[tuple[asyncio.Future[bool], float]] = []  # (place, when it came)
        self._touches: list[tuple[asyncio.Future[bool], float]] = []  # served before routes
        self._empty_at = 0.0  # loop time the stack was last empty

    async def enter(self, *, reserve: bool) -> _Ticket | None:
        """A place, or None: shed (``reserve``: the touch's extra room, and it passes waiting
        routes)."""
        bound = 2 * self.limit if reserve else self.limit
        if self.active < bound and (reserve or not self.waiting):
            self.active += 1
            return _Ticket(self, asyncio.current_task())
        if self.waiting >= self.queue:
            self.shed += 1
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self.waiting:
            self._empty_at = now
        overloaded = now - self._empty_at > self.burst_wait
        wait = min(OVERLOAD_WAIT, self.burst_wait) if overloaded else self.burst_wait
        place: asyncio.Future[bool] = loop.create_future()
        (self._touches if reserve else self._stack).append((place, now))
        self.waiting += 1
        try:
            admitted = await asyncio.wait_for(asyncio.shield(place), wait)
        except TimeoutError:
            if not place.done():
                place.cancel()
                self._gone()
            admitted = place.done() and not place.cancelled() and place.result()
        except BaseException:  # the caller went away while waiting
            if place.done() and not place.cancelled() and place.result():
                self._release()  # the place was handed to us: pass it on
            else:
                place.cancel()
                self._gone()
            raise
        if not admitted:  # its wait ran out, or _release shed it (too old under overload)
            self.shed += 1
            return None
        return _Ticket(self, asyncio.current_task())  # handed over: ``active`` already counts it

    def _gone(self) -> None:
        self.waiting -= 1
        if not self.waiting:
            self._empty_at = asyncio.get_running_loop().time()
        if len(self._stack) > 2 * max(self.queue, 8):  # drop the dead entries (LIFO leaves them)
            self._stack = [(f, t) for f, t in self._stack if not f.done()]
            self._touches = [(f, t) for f, t in self._touches if not f.done()]

    def _release(self) -> None:
        """A place comes free: to the newest live waiter, else back to the pool. Under
        overload a waiter older than ``OVERLOAD_WAIT`` is shed instead (and so is every one
        under it: they are older still), so what is served has not waited."""
        now = asyncio.get_running_loop().time()
        overloaded = self.waiting and now - self._empty_at > self.burst_wait
        while self._touches or self._stack:
            place, came = (self._touches or self._stack).pop()
            if place.done():
                continue
            if overloaded and now - came > OVERLOAD_WAIT:
                place.set_result(False)
                self._gone()
                continue
            place.set_result(True)
            self._gone()
            return
        self.active -= 1

    def leave(self, ticket: _Ticket) -> None:
        if ticket.held:
            ticket.held = False
            self._release()

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """Give the current request's place back while it waits (see the module docstring)."""
        ticket = _ticket.get()
        mine = ticket is not None and ticket.admission is self and ticket.held
        if ticket is None or not mine or ticket.task is not asyncio.current_task():
            yield
            return
        ticket.held = False
        self._release()
        self.parked_now += 1
        try:
            yield
        finally:
            self.parked_now -= 1
            ticket.held = True
            self.active += 1  # resumes without the check: its wait is not wasted


# the current request's place (set by the middleware; two apps in one process each see theirs)
_ticket: ContextVar[_Ticket | None] = ContextVar("admission_ticket", default=None)


@contextlib.contextmanager
def parked() -> Iterator[None]:
    """``Admission.parked`` of the admission that let the current request in (no-op outside
    a request): wrap every wait of a request that holds no Redis connection."""
    ticket = _ticket.get()
    if ticket is None:
        yield
        return
    with ticket.admission.parked():
        yield


class AdmissionMiddleware:
    """Pure ASGI, inside the metrics middleware (a shed request is counted 503 OVERLOADED):
    a request under ``prefix`` over the bound is answered at once with a prebuilt envelope,
    before any handler, Redis or DB work. Its body is read first (``_read_ahead``), holding no
    place."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: Admission,
        prefix: str,
        reserve_paths: frozenset[str],
        body_limit: int,
    ) -> None:
        self.app = app
        self.body_limit = body_limit
        self.admission = admission
        self.prefix = prefix
        self.reserve_paths = reserve_paths
        body = json.dumps(
            {
                "ok": False,
                "request_id": None,
                "error_code": ErrorCode.OVERLOADED.value,
                "error_message": "this replica is at its in-flight bound; retry shortly",
                "retry_after": RETRY_AFTER,
            }
        ).encode()
        self._start = {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER).encode()),
                (b"x-error-code", ErrorCode.OVERLOADED.value.encode()),
            ],
        }
        self._body = {"type": "http.response.body", "body": body}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        ahead = await _read_ahead(receive, self.body_limit)
        ticket = await self.admission.enter(reserve=path in self.reserve_paths)
        if ticket is None:
            await send(self._start)
            await send(self._body)
            return

        async def replay() -> Message:
            return ahead.popleft() if ahead else await receive()

        token = _ticket.set(ticket)
        try:
            await self.app(scope, replay, send)
        finally:
            _ticket.reset(token)
            self.admission.leave(ticket)


async def _read_ahead(receive: Receive, limit: int) -> deque[Message]:
    """The request's messages up to the end of its body (or a disconnect), at most ``limit``
    bytes + one message: the rest, if any, is read by the app as usual (and refused there by
    the body guard). Its time is bounded by the HTTP protocol's body deadline."""
    messages: deque[Message] = deque()
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        size += len(message.get("body", b""))
        if not message.get("more_body", False) or size > limit:
            return messages
