"""The follower rooms: where a cold acquire waits for the pod another caller's deploy brings.

Each cold deploy has its own room (at most ``pod_concurrency - 1`` seats: what its pod can
still hold besides its leader's session). The claim (deploy_claim.lua) seats a caller in a
deploy with a free seat, in the same step that decides it does not lead; the seat is a lease,
renewed while it waits. A follower waits, woken by the registration signal and polling beneath
it, for the pod its deploy recorded to be registered in use. It leaves with the pod, with
``DeployFailed`` (the leader left a failure notice: same image, same failure), with
``LeaderGone`` (the leader's lease lapsed without a result, or its pod went to the warm pool:
the caller acquires again, and the next claim takes the deploy over), or at its own deadline
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
    DeployTimedOut,
    MaxPodsReached,
)
from agent_runtime.resource_manager.state import ResourceState, registered_channel
from agent_runtime.tracing import SCOPE_ID, Tracing

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
    # what the pod is for (the route's request id): the id of a deploy it leads, so that a
    # duplicate of the request joins that deploy instead of making another
    demand_id: str = ""

    @property
    def deploy_id(self) -> str:
        return self.demand_id or self.request_id

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
        seat_hold: float,
        tracing: Tracing | None = None,
    ) -> None:
        """``waits``: the follower wait histogram; a seat is held ``seat_hold`` seconds and
        renewed every ``deploy_lease / 3``."""
        self._state = state
        self._deploys = deploys
        self._notifier = notifier
        self._waits = waits
        self._deploy_lease = deploy_lease
        self.seat_hold = seat_hold
        self.stopping = False  # the replica is stopping: followers leave at their next look
        self._tracing = tracing or Tracing()

    async def follow(self, call: AcquireCall, deploy_id: str) -> AcquiredPod:
        """Wait in ``deploy_id``'s room (the claim seated us) for its pod; the seat is renewed
        while we wait and given back however we leave."""
        scope_id, request_id = call.scope_id, call.request_id
        entered = renewed = _now()
        served = False
        try:
            # parked throughout: it waits on the leader, holding no connection but for a look
            # every poll (a burst's followers would otherwise hold the edge's places)
            attributes = {SCOPE_ID: scope_id, "agent_runtime.deploy_id": deploy_id}
            with (
                self._tracing.span("follower wait", attributes=attributes),
                admission.parked(),
            ):
                async with self._notifier.listen(registered_channel(scope_id)) as listener:
                    while True:
                        if self.stopping:
                            raise MaxPodsReached(f"scope {scope_id}: this replica is stopping")
                        pod = await self._look(call, deploy_id)
                        if pod is not None:
                            served = True
                            return pod
                        remaining = call.remaining()
                        if remaining <= 0:
                            raise call.expired()
                        if _now() - renewed >= self._deploy_lease / 3:
                            await self._deploys.renew_follower_seat(
                                scope_id, deploy_id, request_id, self.seat_hold
                            )
                            renewed = _now()
                        await listener.wait(min(FOLLOWER_POLL, remaining))
        finally:
            self._waits.observe(_now() - entered)
            with contextlib.suppress(Exception):  # with the pod: it still counts in the room
                await self._deploys.leave_follower_seat(
                    scope_id, deploy_id, request_id, served=served
                )

    async def _look(self, call: AcquireCall, deploy_id: str) -> AcquiredPod | None:
        """The deploy's pod once registered in use; None while its leader is on it."""
        scope_id = call.scope_id
        view = await self._deploys.deploy_view(scope_id, deploy_id)
        if view.pod_id is not None:
            # the leader registers its pod before it gives back its lease: a leader that is
            # gone left its pod visible by now
            info = await self._state.pod_info(view.pod_id, scope_id)
            if info is not None:
                if info.phase == "in_use" and info.pod_sse_url:
                    return AcquiredPod(view.pod_id, info.pod_sse_url, info.deploy_ver)
                # its leader's caller left: the pod went warm, for the next acquire to take
                raise LeaderGone(f"scope {scope_id}: deploy {deploy_id}'s pod went warm")
        if view.leader is None and view.failed:
            raise DeployFailed(f"scope {scope_id}: the leader's deploy failed")
        if view.leader is None:
            raise LeaderGone(f"scope {scope_id}: deploy {deploy_id}'s leader lease lapsed")
        return None


def _now() -> float:
    return asyncio.get_running_loop().time()
