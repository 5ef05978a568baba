"""Route and touch: which pod serves a session, and keeping it alive.

``route`` loops on the ``route_place`` script, the only judge of placement: it answers from
the replay cache, refreshes a binding, or places on the first candidate with room in one
round trip. Everything else is the slow path: fill the resolve cache (``need_config``), get a
pod from the resource manager (``need_acquire``: the script reserved a slot of the pod to
come, so queued waiters cannot take it), or wait for a slot (``scope_full``) in a bounded
queue, woken by the scope's ``free`` signal. A slow route renews what it holds (pending
replay marker, reservation, seat) on a short lease. Every wait of a route — the queue, an
acquire (its own deploy, the follower room, one shared with other routes) — ends the moment
the replica starts to stop, with 503 BACKEND_UNAVAILABLE. Hazard: all of it must be given back
on every exit, including cancellation and a client that disconnects; placing gives it back in
the same script.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agent_runtime import admission, logs
from agent_runtime.errors import (
    BackendUnavailable,
    ClientDisconnected,
    NoPodAvailable,
    RequestIdReused,
    ScopeFullTimeout,
    ScopeQueueFull,
)
from agent_runtime.metrics import Metrics
from agent_runtime.notify import Listener, Notifier
from agent_runtime.resource_manager.facade import (
    AcquiredPod,
    DeployFailed,
    DeployInProgress,
    DeployTimedOut,
    MaxPodsReached,
    PodBudgetReached,
    ResourceManagerFacade,
)
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.state import ROUTE_LEASE, SessionState, scope_free_channel
from agent_runtime.single_flight import SingleFlight
from agent_runtime.util import scope_id_of

log = logging.getLogger(__name__)

POLL = 0.5  # safety net under the free signal
# max_pods reported while the scope had fewer candidates: the cap may be held by a pod another
# call has just got and is about to make a candidate (it signals `free` when it does); such a
# route waits and looks again for this long before the cap counts as real (NO_POD_AVAILABLE)
CAP_GRACE = 0.5
MAX_SLOW_STEPS = 20  # config fills and acquires per route: a loop that does not converge ends
PLACED = ("refresh", "placed", "rebound")
# what the gateway is told; the reasons (Kubernetes' own text) go to the log
NO_POD_AT_CAP = "no pod available: the scope is at its pod limit"
NO_POD_DEPLOY_FAILED = "no pod available: a new pod could not be started"
NO_POD_IN_TIME = "no pod available: waited {waited:.0f} s for the scope's new pod"


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
    ) -> None:
        metrics = metrics or Metrics()
        self._placements = {p: metrics.placements.labels(p) for p in (*PLACED, "replay")}
        self._queue_outcomes = metrics.queue_outcomes
        self._queue_wait = metrics.queue_wait
        self._state = state
        self._config = config_store
        self._resources = resources
        self._notifier = notifier
        self._scope_full_timeout = scope_full_timeout
        # scope → the acquire its concurrent routes on this replica share (see _Route.acquire)
        self._acquiring: SingleFlight[str, bool] = SingleFlight()
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
    ) -> dict[str, Any]:
        """``{pod_id, pod_sse_url, placement[, previous_pod_id]}``; the same request_id within
        60 s gets the first answer again (also on another replica)."""
        self._refuse_if_draining()
        scope_id = scope_id_of(group_id, bot_id)
        with logs.bound(request_id=request_id, session_id=session_id, scope_id=scope_id):
            return await self._route(
                request_id, session_id, group_id, bot_id, scope_id, disconnected
            )

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
            reply = await self._state.route_place(
                request_id=request_id, session_id=session_id, scope_id=scope_id, token=token
            )
        except BaseException as exc:
            # the script may have marked the request pending (and reserved a slot) before its
            # reply was read (the caller went away): give them back, or a retry would wait
            await self._give_back(exc, scope_id, request_id, token)
            raise
        if reply[0] in PLACED or reply[0] == "replay":  # the hot path: one round trip
            self._placements[reply[0]].inc()
            return _answer(reply)
        if reply[0] == "reused":  # nothing was taken: nothing to give back
            raise _reused()
        route = _Route(self, request_id, session_id, group_id, bot_id, scope_id, token)
        outcome = "error"
        started = time.perf_counter()
        try:
            answer = await route.run(reply, disconnected)
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
        unreachable: another call would only add its timeout to the 503, and the lease frees
        them within ROUTE_LEASE."""
        if isinstance(exc, RedisConnectionError | RedisTimeoutError):
            return
        with contextlib.suppress(Exception):
            await self._state.release_route(scope_id, request_id, token)

    # --- touch ---------------------------------------------------------------------------------

    async def touch(
        self, session_id: str, *, eos: bool = False, request_id: str = ""
    ) -> dict[str, bool]:
        """``request_id``: an eos re-sent with it (its reply lost) gets the first answer."""
        outcome = await self._state.touch(session_id, eos=eos, request_id=request_id)
        if outcome is None:
            raise _reused()
        touched, released = outcome
        if eos:
            return {"touched": touched, "released": released}
        return {"touched": touched}


class _Route:
    """The slow path of one route call: its seat, its deadline, its listener."""

    def __init__(
        self,
        owner: SessionOrchestrator,
        request_id: str,
        session_id: str,
        group_id: str,
        bot_id: str,
        scope_id: str,
        token: str,
    ) -> None:
        self.o = owner
        self.request_id, self.session_id = request_id, session_id
        self.group_id, self.bot_id, self.scope_id = group_id, bot_id, scope_id
        self.token = token
        self.seated = False  # holds a queue seat (route_place's need_acquire takes it back)
        self.deadline: float | None = None
        self.cap_since: float | None = None  # when acquire first said max_pods
        self.asked_at: float | None = None  # when it first asked for a pod (its deadline's start)
        self.listening: contextlib.AsyncExitStack | None = None
        self.listener: Listener | None = None
        self.closed = False
        self.lease = asyncio.create_task(self._keep_lease(), name=f"route-lease:{request_id}")

    async def _keep_lease(self) -> None:
        # ends on `closed`, not only on cancel: fakeredis (local mode) absorbs a cancellation
        # that lands inside a command, and the loop would go on renewing
        while not self.closed:
            await asyncio.sleep(ROUTE_LEASE / 3)
            if self.closed:
                return
            try:
                await self.o._state.renew_route(self.scope_id, self.request_id, self.token)
            except Exception as exc:  # the next renewal may succeed; the lease is the bound
                log.debug("route %s: lease not renewed: %s", self.request_id, exc)

    async def run(
        self, reply: list[str], disconnected: Callable[[], Awaitable[bool]] | None
    ) -> dict[str, Any]:
        steps = 0
        while True:
            action = reply[0]
            if action in PLACED or action == "replay":
                return _answer(reply)
            if action == "need_config":
                await self.o._config.resolve(self.scope_id, self.group_id, self.bot_id)
            elif action == "need_acquire":  # a slot reserved, the queue seat (if any) left
                self.seated = False
                if not await self.acquire(steps):
                    await self.wait(disconnected, seat=False)
            elif action == "scope_full":  # a route holding a reservation waits on it
                await self.wait(disconnected, seat=reply[1:2] != ["1"])
            elif action == "in_flight":  # a duplicate: wait for the first call's answer
                await self.wait(disconnected, seat=False, duplicate=True)
            elif action == "reused":  # our marker lapsed and another request took the id
                raise _reused()
            else:
                raise BackendUnavailable(f"unexpected route outcome {action!r}")
            if action in ("need_config", "need_acquire"):
                steps += 1
                if steps > MAX_SLOW_STEPS:
                    raise NoPodAvailable(f"scope {self.scope_id}: placement did not converge")
            reply = await self.o._state.route_place(
                request_id=self.request_id,
                session_id=self.session_id,
                scope_id=self.scope_id,
                token=self.token,
                slow=True,
            )

    async def acquire(self, attempt: int) -> bool:
        """Get a pod and make it a candidate; False when a deploy is in flight (wait).

        Concurrent routes of one scope on this replica share one acquire (single flight): a
        cold burst makes one acquire call instead of one per route (each a dozen Redis round
        trips competing with the leader's for the loop), and every sharer then places through
        route_place, the judge; those the pod cannot hold get need_acquire again. Shielded:
        the route that started it going away does not cancel it for the others."""
        if self.asked_at is None:
            self.asked_at = asyncio.get_running_loop().time()
        try:
            async with self.o._until_drained():
                return await self.o._acquiring.run(self.scope_id, lambda: self._acquire(attempt))
        except DeployTimedOut as exc:
            # once, from its first ask: a route never waits the deploy time twice; the time
            # said is its own (a route that joined a shared acquire late waited less)
            log.info("route %s: no pod: %s", self.request_id, exc)
            waited = asyncio.get_running_loop().time() - self.asked_at
            raise NoPodAvailable(NO_POD_IN_TIME.format(waited=waited)) from None
        except MaxPodsReached as exc:
            now = asyncio.get_running_loop().time()
            if self.cap_since is None:
                self.cap_since = now
            if now - self.cap_since < CAP_GRACE:
                return False  # wait for a candidate that may be on its way, then look again
            log.info("route %s: no pod: %s", self.request_id, exc)
            raise NoPodAvailable(NO_POD_AT_CAP) from None

    async def _acquire(self, attempt: int) -> bool:
        config = await self.o._config.resolve(self.scope_id, self.group_id, self.bot_id)
        try:
            pod = await self.o._resources.acquire(
                self.scope_id,
                config.pod_spec,
                config.pool_config(),
                f"{self.request_id}:{self.token[:8]}:{attempt}",
                on_ready=self._make_candidate,
                rule_id=config.rule_id or "",
                rule_pod_budget=config.rule_pod_budget,
                asked_at=self.asked_at,
            )
        except DeployInProgress:
            return False
        except DeployFailed as exc:
            # the reason is Kubernetes' or the loader's text (namespaces, paths, errno): it goes
            # to the log with the request id, never to the gateway
            log.warning(
                "route %s: deploy for scope %s failed: %s", self.request_id, self.scope_id, exc
            )
            raise NoPodAvailable(NO_POD_DEPLOY_FAILED) from None
        except PodBudgetReached as exc:
            # at once: nothing is on its way (no grace as for max_pods); the gateway hears only
            # that a budget is reached, the log says which
            log.info("scope %s: %s (rule %s)", self.scope_id, exc, config.rule_id)
            raise NoPodAvailable("no pod can be had now: a pod budget is reached") from None
        registered = await self.o._state.register_pod(
            self.scope_id, pod.pod_id, pod.pod_sse_url, pod.deploy_ver
        )
        if not registered:
            log.info("scope %s: pod %s is of an old version; not used", self.scope_id, pod.pod_id)
        return True

    async def _make_candidate(self, pod: AcquiredPod) -> None:
        """Called by the deploy leader before it lets go of the deploy lock: a route that
        looks in between finds the pod as a candidate instead of deploying another."""
        await self.o._state.register_pod(self.scope_id, pod.pod_id, pod.pod_sse_url, pod.deploy_ver)

    async def wait(
        self,
        disconnected: Callable[[], Awaitable[bool]] | None,
        *,
        seat: bool,
        duplicate: bool = False,
    ) -> None:
        """Wait for a slot (or the first call's answer), bounded by scope_full_timeout; a
        duplicate also outwaits the lease of a first call that died."""
        loop = asyncio.get_running_loop()
        if self.deadline is None:
            self.deadline = loop.time() + self.o._scope_full_timeout
            if duplicate:
                self.deadline += ROUTE_LEASE
        if seat and not self.seated:
            config = await self.o._config.resolve(self.scope_id, self.group_id, self.bot_id)
            hold = ROUTE_LEASE  # renewed while we run: a crashed replica's seat expires soon
            # seated BEFORE the call: a cancellation while it runs (the seat taken in Redis,
            # its reply not yet read) must still give the seat back (release_route)
            self.seated = True
            if not await self.o._state.take_waiter_seat(
                self.scope_id, self.request_id, hold, 2 * config.scope_concurrency
            ):
                self.seated = False  # refused: the gate kept no seat
                raise ScopeQueueFull(
                    f"scope {self.scope_id} is full and so is its wait queue", retry_after=1
                )
        fresh = self.listener is None
        if self.listener is None:
            self.listening = contextlib.AsyncExitStack()
            self.listener = await self.listening.enter_async_context(
                self.o._notifier.listen(scope_free_channel(self.scope_id))
            )
        remaining = self.deadline - loop.time()
        if remaining <= 0:
            raise ScopeFullTimeout(
                f"scope {self.scope_id}: no slot within {self.o._scope_full_timeout:g} s",
                retry_after=1,
            )
        if fresh:
            # the state was read before we listened: a slot freed in between sent its signal
            # to nobody, so look again first (from now on every signal reaches the listener)
            return
        with admission.parked():  # queued: its place at the edge goes to the fast path
            async with self.o._until_drained():  # answered at the stop signal, seat given back
                await self.listener.wait(min(POLL, remaining))
        if disconnected is not None and await disconnected():
            raise ClientDisconnected(f"{self.request_id}: the caller disconnected")

    async def close(self) -> None:
        """Stop renewing and listening; what is held was given back by the script that placed,
        or by release_route on failure."""
        self.closed = True
        self.lease.cancel()
        await asyncio.wait([self.lease], timeout=1.0)  # never swallows a cancel of our own
        if self.listening is not None:
            await self.listening.aclose()
            self.listening = None


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


def _reused() -> RequestIdReused:
    return RequestIdReused(
        "request_id was used by another request within the last 60 s; use a new request_id"
    )


def _answer(reply: list[str]) -> dict[str, Any]:
    if reply[0] == "replay":
        stored: dict[str, Any] = json.loads(reply[1])
        stored.pop("request_hash", None)  # the binding, not part of the answer
        return stored
    answer: dict[str, Any] = {"pod_id": reply[1], "pod_sse_url": reply[2], "placement": reply[0]}
    if reply[0] == "rebound":
        answer["previous_pod_id"] = reply[3]
    return answer
