"""Admission at the edge: a bound on the API requests one replica works on at once.

Why: past its capacity a replica without a bound took every arrival in, so the work in flight
grew with the backlog; each request held a Redis connection while the saturated loop got round
to its reply, the pool ran dry ("No connection available" → 503 BACKEND_UNAVAILABLE), eos
touches failed so sessions stayed, scopes filled, routes queued for ``scope_full_timeout`` and
job ticks (which share the pool) failed: a collapse that outlived the overload. With the bound
the excess is answered (503 ``OVERLOADED`` + ``Retry-After``, a fixed answer, no Redis or DB
work) and the admitted requests keep the replica at capacity.

Burst or overload (adaptive LIFO with a CoDel-style detector): a request over the bound waits
for a place on a bounded stack, newest first. A backlog that clears within ``burst_wait`` is a
burst: every waiter is served. A backlog that has stood for ``burst_wait`` without a single
place going spare is overload: from then on a waiter is served only while it is fresh
(``OVERLOAD_WAIT``), older ones are shed at once, and the state ends only when a place goes
spare again — not when shedding empties the stack (that was the old rule's flaw: every shed
wave looked like a drained burst, so the next arrivals were given the long burst wait again and
the served p99 at 2 x capacity was 0.5–3 s). LIFO keeps what is served fresh under overload.

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
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.errors import ErrorCode

RETRY_AFTER = 1  # seconds: a shed request is retried (ideally on another replica) soon
OVERLOAD_WAIT = 0.005  # seconds a waiter may have waited and still be served under overload
# Under overload the edge sheds a route before its request becomes an ASGI task once this many
# waiters already stand ready for the next freed places: a few, so that no place idles between
# arrivals, and few enough that the excess never pays for a task (see ``shed_early``).
EARLY_SHED_DEPTH = 4

_Waiter = tuple[asyncio.Future[bool], float]  # (its place, when it came)


@dataclass
class _Ticket:
    admission: Admission
    task: asyncio.Task[object] | None
    held: bool = True


class Admission:
    """The places of one app: ``limit`` requests at work, then a bounded waiting stack.

    Overload is "a backlog has stood ``burst_wait`` seconds and no place has gone spare
    since it formed" (``_backlog_since``); see the module docstring for why shedding does not
    end it. Under overload a newcomer waits at most ``OVERLOAD_WAIT``, and a freed place goes
    to the newest waiter that is still fresh, shedding the stale ones it passes and those at
    the bottom (they are older still); with ``queue`` waiters already there a newcomer is shed
    at once.
    """

    def __init__(self, limit: int, *, queue: int = 0, burst_wait: float = 0.0) -> None:
        self.limit = limit
        self.queue = queue
        self.burst_wait = burst_wait
        self.active = 0
        self.shed = 0  # requests answered OVERLOADED since start
        self.parked_now = 0
        self.waiting = 0
        self._stack: deque[_Waiter] = deque()  # routes and the rest: oldest left, newest right
        self._touches: deque[_Waiter] = deque()  # served before routes
        self._backlog_since: float | None = None  # loop time a backlog formed; None: a place
        # went spare since

    def _overloaded(self, now: float) -> bool:
        return self._backlog_since is not None and now - self._backlog_since > self.burst_wait

    def shed_early(self) -> bool:
        """Whether a route arriving now is to be shed by the HTTP protocol itself, before it
        costs a task, the middleware stack and a place on the stack (counted as shed).

        Why: at 2 x capacity the excess is as many requests as the served ones; shed through
        the ASGI stack each cost ~0.18 ms of the loop (a fifth of a served route), so goodput
        fell to ~75 % of capacity and the loop's own queue put every served route behind the
        shed ones. True when the middleware would shed it for sure (every place taken and the
        stack full), or under overload once ``EARLY_SHED_DEPTH`` waiters stand ready: LIFO
        would serve the newcomer and shed one of those instead, the same count for more work.
        """
        if self.active < self.limit:
            return False
        if self.waiting >= self.queue or (
            self.waiting >= EARLY_SHED_DEPTH and self._overloaded(asyncio.get_running_loop().time())
        ):
            self.shed += 1
            return True
        return False

    async def enter(self, *, reserve: bool) -> _Ticket | None:
        """A place, or None: shed (``reserve``: the touch's extra room, and it passes waiting
        routes)."""
        bound = 2 * self.limit if reserve else self.limit
        if self.active < bound and (reserve or not self.waiting):
            if self.active < self.limit:
                self._backlog_since = None  # a place was spare: whatever stood has cleared
            self.active += 1
            return _Ticket(self, asyncio.current_task())
        if self.waiting >= self.queue:
            self.shed += 1
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._backlog_since is None:
            self._backlog_since = now
        overloaded = self._overloaded(now) and not reserve  # a touch waits its whole burst wait
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
        if not admitted:  # its wait ran out, or _release shed it (stale under overload)
            self.shed += 1
            return None
        return _Ticket(self, asyncio.current_task())  # handed over: ``active`` already counts it

    def _gone(self) -> None:
        self.waiting -= 1
        if len(self._stack) > 2 * max(self.queue, 8):  # drop the dead entries (LIFO leaves them)
            self._stack = deque((f, t) for f, t in self._stack if not f.done())
            self._touches = deque((f, t) for f, t in self._touches if not f.done())

    def _shed(self, place: asyncio.Future[bool]) -> None:
        place.set_result(False)
        self._gone()

    def _release(self) -> None:
        """A place comes free: to the newest live waiter (touches first), else it goes spare.
        Under overload a stale waiter is shed instead of served, and so is every stale one at
        the bottom: what is served has not waited."""
        now = asyncio.get_running_loop().time()
        overloaded = self._overloaded(now)
        for waiters in (self._touches, self._stack):
            stale_sheds = overloaded and waiters is self._stack  # a touch frees what routes took
            if stale_sheds:  # the bottom is the oldest: shed what went stale there
                while waiters and (waiters[0][0].done() or now - waiters[0][1] > OVERLOAD_WAIT):
                    place, _ = waiters.popleft()
                    if not place.done():
                        self._shed(place)
            while waiters:
                place, came = waiters.pop()
                if place.done():
                    continue
                if stale_sheds and now - came > OVERLOAD_WAIT:
                    self._shed(place)
                    continue
                place.set_result(True)
                self._gone()
                return
        self.active -= 1
        self._backlog_since = None  # nobody waited for this place: no backlog stands

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


_SHED_BODY = json.dumps(
    {
        "ok": False,
        "request_id": None,
        "error_code": ErrorCode.OVERLOADED.value,
        "error_message": "this replica is at its in-flight bound; retry shortly",
        "retry_after": RETRY_AFTER,
    }
).encode()
_SHED_HEADERS = (
    ("content-type", "application/json"),
    ("content-length", str(len(_SHED_BODY))),
    ("retry-after", str(RETRY_AFTER)),
    ("x-error-code", ErrorCode.OVERLOADED.value),
)


def _shed_response(*, keep_alive: bool) -> bytes:
    """The whole HTTP/1.1 answer of a shed request, for the protocol to write itself."""
    lines = ["HTTP/1.1 503 Service Unavailable", *(f"{k}: {v}" for k, v in _SHED_HEADERS)]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + _SHED_BODY


class EdgeShed:
    """The protocol's door into admission (``http_server.EarlyAnswer``): the prebuilt 503 for a
    route that ``Admission.shed_early`` sheds, written by the protocol without an ASGI task.
    Touch (``reserve_paths``) is never shed here: it frees what routes took."""

    def __init__(
        self,
        admission: Admission,
        *,
        prefix: str,
        reserve_paths: frozenset[str],
        on_shed: Callable[[str], None],
    ) -> None:
        self.admission = admission
        self._prefix = prefix.encode()
        self._reserve = frozenset(p.encode() for p in reserve_paths)
        self._on_shed = on_shed  # counts it (requests_total by path, 503, OVERLOADED)
        self._keep_alive = _shed_response(keep_alive=True)
        self._close = _shed_response(keep_alive=False)

    def answer_now(self, url: bytes, *, keep_alive: bool) -> bytes | None:
        """The bytes to answer this request with at once, or None: it goes to the app."""
        if not url.startswith(self._prefix):
            return None
        path = url.partition(b"?")[0]
        if path in self._reserve or not self.admission.shed_early():
            return None
        self._on_shed(path.decode("latin-1"))
        return self._keep_alive if keep_alive else self._close


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
        self._start = {
            "type": "http.response.start",
            "status": 503,
            "headers": [(k.encode(), v.encode()) for k, v in _SHED_HEADERS],
        }
        self._body = {"type": "http.response.body", "body": _SHED_BODY}

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
