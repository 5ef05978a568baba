"""Drains in Redis (``drains.py``'s): a pod's drain hash and the index of draining pods, begun
by one script (``drain_begin.lua``: marked and out of the warm pool together) and ended by the
pod's purge (``purge.lua`` drops both). Keys from ``state.py``'s builders; replies decoded here.
"""

from __future__ import annotations

from typing import cast

from agent_runtime.resource_manager.pool_jobs_state import BATCH, SCRIPT_BATCH
from agent_runtime.resource_manager.state import (
    DRAINING_KEY,
    SCOPE_PREFIX,
    ResourceState,
    hash_of,
    pod_drain_key,
    pod_idle_since_key,
    pod_info_key,
)
from agent_runtime.resource_manager.state_values import Drain, DrainBegun


def _drain_of(pod_id: str, raw: dict[str, str]) -> Drain | None:
    if not raw or raw.get("state") not in ("pending", "draining"):
        return None
    return Drain(
        pod_id=pod_id,
        scope_id=raw.get("scope_id", ""),
        state="pending" if raw["state"] == "pending" else "draining",
        trigger=raw.get("trigger", ""),
        deadline=float(raw.get("deadline") or 0.0),
        since=float(raw.get("since") or 0.0),
    )


class DrainState:
    """The drains over a ``ResourceState``'s client."""

    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self._begin = state.script("drain_begin")
        self._read_many = state.script("read_many")

    async def begin(
        self,
        pod_id: str,
        *,
        trigger: str,
        pending: bool,
        seconds: float | None = None,
        deadline: float | None = None,
    ) -> DrainBegun | None:
        """Mark the pod draining (or pending), its deadline ``seconds`` from now (Redis clock)
        or at ``deadline`` (Unix seconds); None: the pod is not registered."""
        assert (seconds is None) != (deadline is None)
        reply = await self._begin(
            keys=[pod_info_key(pod_id), pod_drain_key(pod_id), DRAINING_KEY,
                  pod_idle_since_key(pod_id)],
            args=[pod_id, "" if seconds is None else repr(float(seconds)),
                  "" if deadline is None else repr(float(deadline)), trigger,
                  "pending" if pending else "draining", SCOPE_PREFIX],
        )  # fmt: skip
        if reply[0] == "unknown":
            return None
        return DrainBegun(
            started=reply[0] == "started",
            state="pending" if reply[1] == "pending" else "draining",
            deadline=float(reply[2]),
            trigger=str(reply[3] or ""),
        )

    async def drain_of(self, pod_id: str) -> Drain | None:
        raw = cast(dict[str, str], await self.redis.hgetall(pod_drain_key(pod_id)))
        return _drain_of(pod_id, raw)

    async def draining_pods(self) -> list[str]:
        """Every pod under a drain, soonest deadline first (ZRANGE in slices of BATCH)."""
        pods: list[str] = []
        while True:
            start = len(pods)
            page = cast(list[str], await self.redis.zrange(DRAINING_KEY, start, start + BATCH - 1))
            pods += page
            if len(page) < BATCH:
                return pods

    async def drains(self, pod_ids: list[str]) -> list[Drain]:
        """The drains of these pods (one without a drain hash left out), SCRIPT_BATCH a call."""
        found: list[Drain] = []
        for i in range(0, len(pod_ids), SCRIPT_BATCH):
            chunk = pod_ids[i : i + SCRIPT_BATCH]
            raws = await self._read_many(keys=[pod_drain_key(p) for p in chunk], args=["HGETALL"])
            for pod_id, flat in zip(chunk, raws, strict=True):
                if (drain := _drain_of(pod_id, hash_of(flat))) is not None:
                    found.append(drain)
        return found

    async def count(self) -> int:
        return int(await self.redis.zcard(DRAINING_KEY))
