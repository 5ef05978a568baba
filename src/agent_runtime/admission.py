"""Admission at the edge: a bound on the API requests one replica works on at once.

Why: past its capacity a replica without a bound took every arrival in, so the work in flight
grew with the backlog; each request held a Redis connection while the saturated loop got round
to its reply, the pool ran dry ("No connection available" → 503 BACKEND_UNAVAILABLE), eos
touches failed so sessions stayed, scopes filled, routes queued for ``scope_full_timeout`` and
job ticks (which share the pool) failed: a collapse that outlived the overload. With the bound
the excess is answered at once (503 ``OVERLOADED`` + ``Retry-After``, a fixed answer, no Redis
or DB work) and the admitted requests keep the replica at capacity.

What counts: a request under ``/api/session/`` from the moment it arrives until its answer
is sent. A request *parked* (a route in its scope's wait queue, a follower waiting for a
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
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from agent_runtime.errors import ErrorCode

RETRY_AFTER = 1  # seconds: a shed request is retried (ideally on another replica) soon


@dataclass
class _Ticket:
    admission: Admission
    task: asyncio.Task[object] | None
    held: bool = True


@dataclass
class Admission:
    """The count of admitted requests of one app; ``limit`` from ``max_in_flight``."""

    limit: int
    active: int = 0
    shed: int = 0  # requests answered OVERLOADED since start
    parked_now: int = 0

    def enter(self, *, reserve: bool) -> _Ticket | None:
        """A place, or None when the bound is reached (``reserve``: the touch's extra room)."""
        bound = 2 * self.limit if reserve else self.limit
        if self.active >= bound:
            self.shed += 1
            return None
        self.active += 1
        return _Ticket(self, asyncio.current_task())

    def leave(self, ticket: _Ticket) -> None:
        if ticket.held:
            ticket.held = False
            self.active -= 1

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """Give the current request's place back while it waits (see the module docstring)."""
        ticket = _ticket.get()
        if (
            ticket is None
            or ticket.admission is not self
            or not ticket.held
            or ticket.task is not asyncio.current_task()
        ):
            yield
            return
        ticket.held = False
        self.active -= 1
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
    before its body is read and before any handler, Redis or DB work."""

    def __init__(
        self, app: ASGIApp, *, admission: Admission, prefix: str, reserve_paths: frozenset[str]
    ) -> None:
        self.app = app
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
        ticket = self.admission.enter(reserve=path in self.reserve_paths)
        if ticket is None:
            await send(self._start)
            await send(self._body)
            return
        token = _ticket.set(ticket)
        try:
            await self.app(scope, receive, send)
        finally:
            _ticket.reset(token)
            self.admission.leave(ticket)
