"""The follower room: where an acquire waits for a pod another caller's deploy brings.

A follower takes a seat (at most ``pod_concurrency - 1``: what the new pod can still hold; a
seat is a lease, renewed while it waits) and waits, woken by the registration signal and
polling beneath it, for an in-use pod of the scope registered since the leader's acquire
started. It leaves with the pod, with ``DeployFailed`` (the leader left a failure notice: same
image, same failure), with ``LeaderGone`` (the leader's lease lapsed without a result: the
caller acquires again and one caller takes the deploy over), or at its own deadline
(``DeployTimedOut``). Hazard: the seat is given back on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Histogram

from agent_runtime import admission
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.models import (
    AcquiredPod,
    DeployFailed,
    DeployInProgress,
    DeployTimedOut,
    MaxPodsReached,
)
from agent_runtime.resource_manager.state import ResourceState, registered_channel

FOLLOWER_MARGIN = 10  # seconds a caller waits beyond ready_timeout (registration overhead)
FOLLOWER_POLL = 0.25  # safety net under the registration signal

OnReady = Callable[[AcquiredPod], Awaitable[object]]


@dataclass(frozen=True)
class AcquireCall:
    """One acquire call: what its deploy or its follower wait needs."""

    scope_id: str
    pod_spec: dict[str, Any]
    pool_config: Mapping[str, int | str]
    request_id: str
    started_at: float  # Redis seconds: every pod registered since may be ours to share
    on_ready: OnReady | None
    rule_id: str = ""  # the rule whose pod budget a new pod counts against ("" = none)
    rule_pod_budget: int = 0  # 0 = unbounded
    asked_at: float = 0.0  # event-loop time the caller first asked for a pod

    @property
    def ready_timeout(self) -> float:
        return float(self.pod_spec.get("ready_timeout") or 300)

    @property
    def deadline(self) -> float:
        """Event-loop time after which the caller waits no longer, whatever is on its way."""
        return self.asked_at + self.ready_timeout + FOLLOWER_MARGIN

    def remaining(self) -> float:
        """Seconds left until the deadline (≤ 0: passed)."""
        return self.deadline - asyncio.get_running_loop().time()

    def expired(self) -> DeployTimedOut:
        waited = asyncio.get_running_loop().time() - self.asked_at
        return DeployTimedOut(
            f"scope {self.scope_id}: no pod within {waited:.1f} s (ready_timeout "
            f"{self.ready_timeout:g} s + {FOLLOWER_MARGIN} s from the first ask)",
            waited=waited,
        )


class LeaderGone(Exception):
    """The leader's lease lapsed and it left no result: acquire again (one caller takes over)."""


class FollowerRoom:
    def __init__(
        self,
        *,
        state: ResourceState,
        deploys: DeployState,
        notifier: Notifier,
        waits: Histogram,
        deploy_lease: float,
        seat_hold: int,
    ) -> None:
        """``waits``: the follower wait histogram; a seat is held ``seat_hold`` seconds and
        renewed every ``deploy_lease / 3``."""
        self._state = state
        self._deploys = deploys
        self._notifier = notifier
        self._waits = waits
        self._deploy_lease = deploy_lease
        self._seat_hold = seat_hold
        self.stopping = False  # the replica is stopping: followers leave at their next look

    async def follow_in_flight(self, call: AcquireCall, refusal: Exception) -> AcquiredPod:
        """The scope may not grow: follow a deploy in flight (its pod may have room for us),
        wait for a warm one, or raise ``refusal``."""
        view = await self._deploys.deploy_view(call.scope_id)
        if view.leader is None and not view.cold and view.warm:
            # only the warm pool's deploys hold the cap: their pods come as warm pods, to be
            # taken by a later acquire, never handed to a follower
            raise DeployInProgress(f"scope {call.scope_id}: a warm pod is being deployed")
        if view.leader is not None or view.cold:
            # the leader's start, read now: a leader that registered its pod just before we
            # started may end its lease before follow looks
            return await self.follow(call, min(call.started_at, view.leader_started))
        raise refusal

    async def follow(self, call: AcquireCall, since: float) -> AcquiredPod:
        """Wait in the follower room for the leader's pod (registered since ``since``); the
        seat is a lease too, renewed while we wait. ``LeaderGone`` when the leader's lease
        lapsed without a result: the caller acquires again and may take over."""
        scope_id, request_id = call.scope_id, call.request_id
        limit = max(int(call.pool_config.get("pod_concurrency", 1)) - 1, 0)
        entered = renewed = _now()
        try:
            # inside the try: a cancellation while the gate's reply is in flight still gives
            # the seat back (ZREM of a seat we never got is harmless)
            if not await self._take_seat(call, limit):
                raise DeployInProgress(
                    f"scope {scope_id}: a deploy is running and its room is full"
                )
            async with self._notifier.listen(registered_channel(scope_id)) as listener:
                while True:
                    if self.stopping:
                        raise MaxPodsReached(f"scope {scope_id}: this replica is stopping")
                    # the leader first, then the pods: a leader registers its pod before it
                    # gives back its lease, so one that is gone left its pod visible by now
                    view = await self._deploys.deploy_view(scope_id)
                    since = min(since, view.leader_started)
                    fresh = await self._state.in_use_pod_since(scope_id, since)
                    if fresh is not None:
                        return fresh
                    if view.leader is None and view.failed:
                        raise DeployFailed(f"scope {scope_id}: the leader's deploy failed")
                    if view.leader is None and not view.cold:
                        # no leader, and no caller on its way to the lock: the leader died
                        raise LeaderGone(f"scope {scope_id}: the deploy leader's lease lapsed")
                    remaining = call.remaining()
                    if remaining <= 0:
                        raise call.expired()
                    if _now() - renewed >= self._deploy_lease / 3:
                        if not await self._take_seat(call, limit):
                            raise DeployInProgress(f"scope {scope_id}: the room filled up")
                        renewed = _now()
                    with admission.parked():  # waits on the leader, holds no connection
                        await listener.wait(min(FOLLOWER_POLL, remaining))
        finally:
            self._waits.observe(_now() - entered)
            with contextlib.suppress(Exception):
                await self._deploys.leave_follower_seat(scope_id, request_id)

    async def _take_seat(self, call: AcquireCall, limit: int) -> bool:
        return await self._deploys.take_follower_seat(
            call.scope_id, call.request_id, self._seat_hold, limit
        )


def _now() -> float:
    return asyncio.get_running_loop().time()
