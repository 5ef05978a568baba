"""What the resource manager asks of the session side, declared here, on its own floor.

The resource manager sits below the session manager and never imports it: it holds a
``SessionSide`` that the session manager implements (``SessionManagerFacade``) and the
app's wiring plugs in. Three questions, all idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping
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


class SessionSide(Protocol):
    async def notify_pod_dead(self, pod_id: str) -> int:
        """The pod is gone: evict its sessions and drop its registrations. Returns the
        sessions evicted."""
        ...

    async def retire_pod(self, pod_id: str) -> int:
        """The pod is being drained: no new session may be placed on it (its sessions stay
        until they end or are rebound). Returns the live sessions it still carries."""
        ...

    async def reconcile_pods(self, view: Mapping[str, str]) -> dict[str, PodUsage]:
        """For each ``pod_id → scope_id``: is it a placement candidate, how many sessions."""
        ...
