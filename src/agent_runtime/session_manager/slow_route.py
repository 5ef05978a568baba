"""The slow path of one route call: config fill, acquire, the wait queue.

A route whose first ``route_place`` did not answer (hot path: ``orchestrator``) becomes a
``SlowRoute``: it loops on ``route_place`` (``slow``: placing gives back its seat and its
reservation in the same script), filling the resolve cache (``need_config``), getting a pod
from the resource manager (``need_acquire``: a slot of the pod to come is reserved for it, and
the route's own acquire leads a deploy or follows one in flight: a cold burst that needs K
pods makes K deploys at once) or waiting for a slot
(``scope_full``, ``in_flight``) in the bounded queue, woken by the scope's ``free`` signal or
every ``POLL``. While it runs it renews what it holds (pending replay marker, reservation,
seat) on a short lease. It works with what its orchestrator gives it (``RouteContext``), and
every wait of it ends the moment the replica starts to stop (``until_drained``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from agent_runtime import admission
from agent_runtime.errors import (
    ClientDisconnected,
    NoPodAvailable,
    RequestIdReused,
    ScopeFullTimeout,
    ScopeQueueFull,
)
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
from agent_runtime.session_manager.replies import Placement, RoutePlacement
from agent_runtime.session_manager.scope_cache import ScopeConfig
from agent_runtime.session_manager.state import ROUTE_LEASE, SessionState, scope_free_channel
from agent_runtime.tracing import SCOPE_ID, OpenSpan, Tracing

log = logging.getLogger(__name__)

POLL = 0.5  # safety net under the free signal
WAITING = frozenset({Placement.SCOPE_FULL, Placement.IN_FLIGHT})  # a queue wait goes on
# max_pods reported while the scope had fewer candidates: the cap may be held by a pod another
# call has just got and is about to make a candidate (it signals `free` when it does); such a
# route waits and looks again for this long before the cap counts as real (NO_POD_AVAILABLE)
CAP_GRACE = 0.5
# config fills and acquires that brought a pod, per route: a loop that does not converge ends
# (an acquire that waits for a deploy under way is bounded by the wait's deadline instead)
MAX_SLOW_STEPS = 20
# what the gateway is told; the reasons (Kubernetes' own text) go to the log
NO_POD_AT_CAP = "no pod available: the scope is at its pod limit"
NO_POD_DEPLOY_FAILED = "no pod available: a new pod could not be started"
NO_POD_IN_TIME = "no pod available: waited {waited:.0f} s for the scope's new pod"


@dataclass(frozen=True, slots=True)
class RouteContext:
    """What every slow route of one orchestrator works with."""

    state: SessionState
    config: ConfigStore
    resources: ResourceManagerFacade
    notifier: Notifier
    scope_full_timeout: float  # a route's wait for a slot, from its first wait
    # a block whose wait ends with 503 the moment the replica starts to stop
    until_drained: Callable[[], AbstractAsyncContextManager[None]]
    tracing: Tracing  # the queue wait's span


class SlowRoute:
    """The slow path of one route call: its seat, its deadline, its listener."""

    def __init__(
        self,
        context: RouteContext,
        request_id: str,
        session_id: str,
        group_id: str,
        bot_id: str,
        scope_id: str,
        token: str,
    ) -> None:
        self.ctx = context
        self.request_id, self.session_id = request_id, session_id
        self.group_id, self.bot_id, self.scope_id = group_id, bot_id, scope_id
        self.token = token
        self.seated = False  # holds a queue seat (route_place's need_acquire takes it back)
        self.deadline: float | None = None
        self.cap_since: float | None = None  # when acquire first said max_pods
        self.asked_at: float | None = None  # when it first asked for a pod (its deadline's start)
        self._config: ScopeConfig | None = None  # resolved once per route (scope_config)
        self.listening: contextlib.AsyncExitStack | None = None
        self.listener: Listener | None = None
        self.closed = False
        self.queue_span: OpenSpan | None = None  # the queue wait's span while the route waits
        self.lease = asyncio.create_task(self._keep_lease(), name=f"route-lease:{request_id}")

    async def _keep_lease(self) -> None:
        # ends on `closed`, not only on cancel: fakeredis (local mode) absorbs a cancellation
        # that lands inside a command, and the loop would go on renewing
        while not self.closed:
            await asyncio.sleep(ROUTE_LEASE / 3)
            if self.closed:
                return
            try:
                await self.ctx.state.renew_route(self.scope_id, self.request_id, self.token)
            except Exception as exc:  # the next renewal may succeed; the lease is the bound
                log.debug("route %s: lease not renewed: %s", self.request_id, exc)

    async def run(
        self, placement: RoutePlacement, disconnected: Callable[[], Awaitable[bool]] | None
    ) -> dict[str, Any]:
        steps = attempts = 0  # steps: what must converge; attempts: acquires made
        while True:
            action = placement.action
            if action not in WAITING:
                self._waited()
            if placement.answered:
                return placement.answer()
            if action is Placement.NEED_CONFIG:
                await self.scope_config(fresh=True)
                steps += 1
            elif action is Placement.NEED_ACQUIRE:  # a slot reserved, the queue seat (if any) left
                self.seated = False
                attempts += 1
                if await self.acquire(attempts):
                    steps += 1
                else:  # the scope's deploys are under way: a wait bounded by its deadline
                    await self.wait(disconnected, seat=False)
            elif action is Placement.SCOPE_FULL:  # a route holding a reservation waits on it
                await self.wait(disconnected, seat=not placement.reserved)
            elif action is Placement.IN_FLIGHT:  # a duplicate: wait for the first call's answer
                await self.wait(disconnected, seat=False, duplicate=True)
            else:  # REUSED: our marker lapsed and another request took the id
                raise reused()
            if steps > MAX_SLOW_STEPS:
                raise NoPodAvailable(f"scope {self.scope_id}: placement did not converge")
            placement = await self.ctx.state.route_place(
                request_id=self.request_id,
                session_id=self.session_id,
                scope_id=self.scope_id,
                token=self.token,
                slow=True,
            )

    def _waited(self) -> None:
        """The queue wait is over (a slot, a pod to acquire, the answer): its span ends."""
        if self.queue_span is not None:
            self.queue_span.end()
            self.queue_span = None

    async def scope_config(self, *, fresh: bool = False) -> ScopeConfig:
        """The scope's configuration, resolved once per route: the cache fill, the acquire
        and the queue's size all use the same one. ``fresh``: route_place found the cache
        missing or stale, so resolve again (and fill it)."""
        if fresh or self._config is None:
            self._config = await self.ctx.config.resolve(self.scope_id, self.group_id, self.bot_id)
        return self._config

    async def acquire(self, attempt: int) -> bool:
        """Get a pod and make it a candidate; False when the scope's deploys are all under
        way (wait, then ask again).

        Each route acquires for itself (its request id names the deploy it would lead): the
        resource manager's claim seats it in a deploy in flight with room, or starts one, so
        a cold burst that needs K pods makes K deploys at once; a duplicate of the request
        joins the deploy it already leads. route_place then judges: a route the pod cannot
        hold (another took its place) gets need_acquire again."""
        if self.asked_at is None:
            self.asked_at = asyncio.get_running_loop().time()
        try:
            async with self.ctx.until_drained():
                return await self._acquire(attempt)
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
        config = await self.scope_config()
        try:
            pod = await self.ctx.resources.acquire(
                self.scope_id,
                config.pod_spec,
                config.pool_config(),
                f"{self.request_id}:{self.token[:8]}:{attempt}",
                on_ready=self._make_candidate,
                rule_id=config.rule_id or "",
                rule_pod_budget=config.rule_pod_budget,
                asked_at=self.asked_at,
                demand_id=self.request_id,
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
        registered = await self.ctx.state.register_pod(
            self.scope_id, pod.pod_id, pod.pod_sse_url, pod.deploy_ver
        )
        if not registered:
            log.info("scope %s: pod %s is of an old version; not used", self.scope_id, pod.pod_id)
        return True

    async def _make_candidate(self, pod: AcquiredPod) -> None:
        """Called by the deploy leader before it lets go of the deploy lock: a route that
        looks in between finds the pod as a candidate instead of deploying another."""
        await self.ctx.state.register_pod(
            self.scope_id, pod.pod_id, pod.pod_sse_url, pod.deploy_ver
        )

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
            self.deadline = loop.time() + self.ctx.scope_full_timeout
            if duplicate:
                self.deadline += ROUTE_LEASE
        if seat and not self.seated:
            config = await self.scope_config()
            hold = ROUTE_LEASE  # renewed while we run: a crashed replica's seat expires soon
            # seated BEFORE the call: a cancellation while it runs (the seat taken in Redis,
            # its reply not yet read) must still give the seat back (release_route)
            self.seated = True
            if not await self.ctx.state.take_waiter_seat(
                self.scope_id, self.request_id, hold, 2 * config.scope_concurrency
            ):
                self.seated = False  # refused: the gate kept no seat
                raise ScopeQueueFull(
                    f"scope {self.scope_id} is full and so is its wait queue", retry_after=1
                )
        if self.queue_span is None:  # one span from the first poll to the wait's end
            self.queue_span = self.ctx.tracing.open_span(
                "queue wait", attributes={SCOPE_ID: self.scope_id, "agent_runtime.seated": seat}
            )
        fresh = self.listener is None
        if self.listener is None:
            self.listening = contextlib.AsyncExitStack()
            self.listener = await self.listening.enter_async_context(
                self.ctx.notifier.listen(scope_free_channel(self.scope_id))
            )
        if fresh:
            # the state was read before we listened: a slot freed in between sent its signal
            # to nobody, so look again first (from now on every signal reaches the listener);
            # even past the deadline (a first listen waits for its subscription): that look
            # says what the wait ends with (a slot, or Redis away)
            return
        remaining = self.deadline - loop.time()
        if remaining <= 0:
            raise ScopeFullTimeout(
                f"scope {self.scope_id}: no slot within {self.ctx.scope_full_timeout:g} s",
                retry_after=1,
            )
        with admission.parked():  # queued: its place at the edge goes to the fast path
            async with self.ctx.until_drained():  # answered at the stop signal, seat given back
                await self.listener.wait(min(POLL, remaining))
        if disconnected is not None and await disconnected():
            raise ClientDisconnected(f"{self.request_id}: the caller disconnected")

    async def close(self) -> None:
        """Stop renewing and listening; what is held was given back by the script that placed,
        or by release_route on failure."""
        self.closed = True
        self._waited()
        self.lease.cancel()
        await asyncio.wait([self.lease], timeout=1.0)  # never swallows a cancel of our own
        if self.listening is not None:
            await self.listening.aclose()
            self.listening = None


def reused() -> RequestIdReused:
    return RequestIdReused(
        "request_id was used by another request within the last 60 s; use a new request_id"
    )
