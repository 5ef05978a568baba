"""Route and touch: which pod serves a session, and keeping it alive.

``route`` loops on the ``route_place`` script, the only judge of placement: it answers from
the replay cache, refreshes a binding, or places on the first candidate with room in one
round trip. Everything else is the slow path (``slow_route.SlowRoute``): fill the resolve
cache (``need_config``), get a pod from the resource manager (``need_acquire``: the script
reserved a slot of the pod to come, so queued waiters cannot take it), or wait for a slot
(``scope_full``) in a bounded queue, woken by the scope's ``free`` signal. A slow route renews
what it holds (pending replay marker, reservation, seat) on a short lease. Every wait of a
route — the queue, an acquire (its own deploy, the follower room, one shared with other
routes) — ends the moment the replica starts to stop (``drain``), with 503
BACKEND_UNAVAILABLE. Hazard: all of it must be given back on every exit, including
cancellation and a client that disconnects; placing gives it back in the same script.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.exceptions import ClusterError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agent_runtime import logs
from agent_runtime.errors import (
    BackendUnavailable,
    ClientDisconnected,
    NoPodAvailable,
    RequestIdReused,
    ScopeFullTimeout,
    ScopeQueueFull,
)
from agent_runtime.metrics import Metrics
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.pod_report import PodReport
from agent_runtime.session_manager.replies import PLACING, Placement
from agent_runtime.session_manager.slow_route import RouteContext, SlowRoute, reused
from agent_runtime.session_manager.state import SessionState
from agent_runtime.tracing import Tracing
from agent_runtime.util import scope_id_of


class SessionOrchestrator:
    def __init__(
        self,
        *,
        state: SessionState,
        config_store: ConfigStore,
        resources: ResourceManagerFacade,
        notifier: Notifier,
        scope_full_timeout: float,
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        metrics = metrics or Metrics()
        # off: annotate is a no-op method (no span, no OpenTelemetry call on the hot path)
        self._tracing = tracing = tracing or Tracing()
        self._placements = {
            p.value: metrics.placements.labels(p.value) for p in (*PLACING, Placement.REPLAY)
        }
        self._queue_outcomes = metrics.queue_outcomes
        self._queue_wait = metrics.queue_wait
        self._state = state
        self._slow = RouteContext(
            state=state,
            config=config_store,
            resources=resources,
            notifier=notifier,
            scope_full_timeout=scope_full_timeout,
            until_drained=self._until_drained,
            tracing=tracing,
        )
        self._reports = PodReport(state=state, resources=resources, metrics=metrics)
        self.draining = False
        self._waits: set[asyncio.Timeout] = set()  # the waits drain() ends

    def drain(self) -> None:
        """The replica is stopping: new routes are refused, waiting ones answered at once (503,
        the gateway retries on another replica). Touch keeps working until the server closes."""
        self.draining = True
        for wait in list(self._waits):
            with contextlib.suppress(RuntimeError):  # one that is ending anyway
                wait.reschedule(0)  # due now: its task is interrupted at the next loop pass

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise BackendUnavailable("this replica is shutting down", retry_after=1)

    @contextlib.asynccontextmanager
    async def _until_drained(self) -> AsyncIterator[None]:
        """The block's wait ends the moment the replica starts to stop, with 503
        BACKEND_UNAVAILABLE: a waiting route is answered at once (its caller gives back its
        seat and reservation), never cut off by the shutdown later (an HTTP 500 without a
        body). The block runs in the route's own task (its admission place parks as before);
        what it waited for goes on without it (a shared acquire and its deploy are shielded:
        their pod serves other routes)."""
        self._refuse_if_draining()
        try:
            async with asyncio.timeout(None) as wait:
                self._waits.add(wait)
                if self.draining:  # the signal came between the check and the add
                    wait.reschedule(0)
                try:
                    yield
                finally:
                    self._waits.discard(wait)
        except TimeoutError:
            self._refuse_if_draining()
            raise

    # --- route ---------------------------------------------------------------------------------

    async def route(
        self,
        request_id: str,
        session_id: str,
        group_id: str,
        bot_id: str,
        *,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
        failed_pod_id: str | None = None,
    ) -> dict[str, Any]:
        """``{pod_id, pod_sse_url, placement[, previous_pod_id]}``; the same request_id within
        60 s gets the first answer again (also on another replica). ``failed_pod_id``: the
        gateway saw that pod's stream fail; if the session is on it and it is dead, this call
        answers ``rebound`` (``pod_report.py``; the slow path: without it, one EVALSHA)."""
        self._refuse_if_draining()
        scope_id = scope_id_of(group_id, bot_id)
        self._tracing.annotate(scope_id=scope_id, session_id=session_id)
        with logs.bound(request_id=request_id, session_id=session_id, scope_id=scope_id):
            if failed_pod_id:
                await self._reports.check(session_id, scope_id, failed_pod_id)
            answer = await self._route(
                request_id, session_id, group_id, bot_id, scope_id, disconnected
            )
        self._tracing.annotate(placement=answer.get("placement"))
        return answer

    async def _route(
        self,
        request_id: str,
        session_id: str,
        group_id: str,
        bot_id: str,
        scope_id: str,
        disconnected: Callable[[], Awaitable[bool]] | None,
    ) -> dict[str, Any]:
        token = uuid.uuid4().hex
        try:
            placement = await self._state.route_place(
                request_id=request_id, session_id=session_id, scope_id=scope_id, token=token
            )
        except BaseException as exc:
            # the script may have marked the request pending (and reserved a slot) before its
            # reply was read (the caller went away): give them back, or a retry would wait
            await self._give_back(exc, scope_id, request_id, token)
            raise
        if placement.answered:  # the hot path: one round trip
            self._placements[placement.action.value].inc()
            return placement.answer()
        if placement.action is Placement.REUSED:  # nothing was taken: nothing to give back
            raise reused()
        route = SlowRoute(self._slow, request_id, session_id, group_id, bot_id, scope_id, token)
        outcome = "error"
        started = time.perf_counter()
        try:
            answer = await route.run(placement, disconnected)
            outcome = "placed"
            self._placements[str(answer.get("placement", "replay"))].inc()
            return answer
        except BaseException as exc:
            outcome = _outcome(exc)
            await self._give_back(exc, scope_id, request_id, token)
            raise
        finally:
            await route.close()
            self._queue_outcomes.labels(outcome).inc()
            self._queue_wait.observe(time.perf_counter() - started)

    async def _give_back(
        self, exc: BaseException, scope_id: str, request_id: str, token: str
    ) -> None:
        """A failed route gives back its marker, reservation and seat — unless Redis is
        unreachable, or a cluster's retries for the slot ran out (down, uncovered, redirected
        without end): another call would only add its timeout to the 503, and the lease frees
        them within ROUTE_LEASE."""
        unreachable = RedisConnectionError | RedisTimeoutError | ClusterError | SlotNotCoveredError
        if isinstance(exc, unreachable):
            return
        with contextlib.suppress(Exception):
            await self._state.release_route(scope_id, request_id, token)

    # --- touch ---------------------------------------------------------------------------------

    async def touch(
        self,
        session_id: str,
        *,
        eos: bool = False,
        request_id: str = "",
        scope_id: str | None = None,
    ) -> dict[str, bool]:
        """``request_id``: an eos re-sent with it (its reply lost) gets the first answer.
        ``scope_id``: the scope the gateway named (bot_id + extra.group_id), or None."""
        self._tracing.annotate(scope_id=scope_id, session_id=session_id)
        outcome = await self._state.touch(
            session_id, eos=eos, request_id=request_id, scope_id=scope_id
        )
        if outcome is None:
            raise reused()
        if eos:
            return {"touched": outcome.touched, "released": outcome.released}
        return {"touched": outcome.touched}


def _outcome(exc: BaseException) -> str:
    """How a slow route ended, as a metrics label (a fixed set)."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    labels: dict[type[BaseException], str] = {
        ScopeFullTimeout: "timeout",
        ScopeQueueFull: "queue_full",
        ClientDisconnected: "disconnected",
        NoPodAvailable: "no_pod",
        BackendUnavailable: "backend",
        RequestIdReused: "reused",
    }
    return labels.get(type(exc), "error")
