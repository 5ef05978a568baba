"""What a gateway's report of a pod reads and changes in Redis: the per-pod probe window
(``pod_report.lua`` on ``resource:pod:{sid}:{pod_id}:reported``)."""

from __future__ import annotations

from typing import NamedTuple

from agent_runtime.resource_manager.state import ResourceState, pod_reported_key


class ReportClaim(NamedTuple):
    probe: bool  # this caller probes (the window is its own)
    seen: str  # else: "probing" (a probe of the window runs) or the window's verdict


class ReportState:
    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self._gate = state.script("pod_report")

    async def claim(self, scope_id: str, pod_id: str, window: float) -> ReportClaim:
        """The window's probe, if nobody took it (pod_report.lua ``claim``)."""
        first, seen = await self._gate(
            keys=[pod_reported_key(scope_id, pod_id)], args=["claim", max(1, round(window * 1000))]
        )
        return ReportClaim(bool(int(first)), str(seen))

    async def answer(self, scope_id: str, pod_id: str, verdict: str) -> None:
        """The window's verdict, for the reports that come while it lasts."""
        await self._gate(keys=[pod_reported_key(scope_id, pod_id)], args=["answer", verdict])

    async def seen(self, scope_id: str, pod_id: str) -> str | None:
        """What the window says now: "probing", a verdict, or None (no window)."""
        value = await self.redis.get(pod_reported_key(scope_id, pod_id))
        return None if value is None else str(value)
