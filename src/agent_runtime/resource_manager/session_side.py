"""What the resource manager asks of the session side, declared here, on its own floor.

The resource manager sits below the session manager and never imports it: it holds a
``SessionSide`` that the session manager implements (``SessionManagerFacade``) and the
app's wiring plugs in. Four questions, all idempotent, the last read only: the demand a
predictive warm pool is sized by (warm_policy.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PodUsage:
    """How the session side uses one (scope, pod)."""

    candidate: bool  # new sessions may be placed on it
    sessions: int  # live sessions on it now

    @property
    def unused(self) -> bool:
        return not self.candidate and self.sessions == 0


# The arrival rate of new sessions the session side measures per scope (two EWMAs, updated by
# each placement): the windows the resource manager plans with.
ARRIVAL_FAST_WINDOW = 15.0  # seconds: sees a flash crowd within seconds
ARRIVAL_SLOW_WINDOW = 300.0  # seconds: remembers a small tenant's rare arrivals


@dataclass(frozen=True, slots=True)
class ScopeDemand:
    """A scope's demand as the session side sees it now."""

    arrivals_fast: float  # new sessions per second, EWMA over ARRIVAL_FAST_WINDOW
    arrivals_slow: float  # the same over ARRIVAL_SLOW_WINDOW
    sessions: int  # live sessions
    queued: int  # routes waiting for a slot: queue seats and reservations (live)


class SessionSide(Protocol):
    async def notify_pod_dead(self, scope_id: str, pod_id: str) -> int:
        """The pod (of ``scope_id``: a pod belongs to one scope, the resource manager's record
        names it) is gone: evict its sessions and drop its registration. Returns the sessions
        evicted."""
        ...

    async def retire_pod(self, scope_id: str, pod_id: str) -> int:
        """The pod (of ``scope_id``) is being drained: no new session may be placed on it (its
        sessions stay until they end or are rebound). Returns the live sessions it still carries."""
        ...

    async def reconcile_pods(self, view: Mapping[str, str]) -> dict[str, PodUsage]:
        """For each ``pod_id → scope_id``: is it a placement candidate, how many sessions."""
        ...

    async def scope_demand(self, scope_ids: Sequence[str]) -> dict[str, ScopeDemand]:
        """Each scope's arrival rates (decayed to now), live sessions and waiting routes."""
        ...
