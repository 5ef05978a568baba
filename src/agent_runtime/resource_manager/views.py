"""``ResourceViews``: the resource manager's state for an operator, read only — the admin
views (``admin.py``: a scope's pool, a pod's info, the foreign pods report) and the gauges
read when /metrics is scraped (``Services.update_gauges``). Keys from ``state.py``'s builders.

Each answer costs a bounded number of pipelined reads, except the gauges' O(pods) ones, which
read in slices (``PoolJobsState.pod_phases``).
"""

from __future__ import annotations

import json
from typing import Any, cast

from agent_runtime.resource_manager.drain_state import DrainState
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import (
    FOREIGN_COUNT_KEY,
    FOREIGN_PODS_KEY,
    POD_VIEW_FIELDS,
    ResourceState,
    deploy_lock_key,
    placeholder_deadline,
    pod_info_key,
    scope_cold_deploys_key,
    scope_config_key,
    scope_deploying_key,
    scope_followers_key,
    scope_idle_key,
    scope_pods_key,
)
from agent_runtime.resource_manager.state_values import Drain


class ResourceViews:
    """Read-only views over a ``ResourceState``'s client."""

    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self._state = state
        self._pods = PoolJobsState(state)
        self._drains = DrainState(state)

    # --- admin views -----------------------------------------------------------------------------

    async def scope_pool(self, scope_id: str) -> dict[str, Any]:
        """A scope's pool: parameters, pods with their phase, warm pods, live placeholders
        (deploys in flight), and the cold deploys: each one's id, leader (its lock's token names
        the replica that leads it; null once lapsed) and followers (live seats)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(scope_config_key(scope_id))
            pipe.zrange(scope_pods_key(scope_id), 0, -1)
            pipe.smembers(scope_idle_key(scope_id))
            pipe.smembers(scope_deploying_key(scope_id))
            pipe.zrange(scope_cold_deploys_key(scope_id), 0, 99)
            pipe.time()
            config, pods, idle, deploying, deploy_ids, (now, micros) = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for deploy_id in deploy_ids:
                pipe.get(deploy_lock_key(scope_id, deploy_id))
                pipe.zcount(scope_followers_key(scope_id, deploy_id), now + micros / 1e6, "+inf")
            per_deploy = await pipe.execute()
        cold = [
            {"deploy_id": d, "leader": per_deploy[2 * i], "followers": int(per_deploy[2 * i + 1])}
            for i, d in enumerate(deploy_ids)
        ]
        leaders = [c["leader"] for c in cold if c["leader"] is not None]
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pods:
                pipe.hmget(pod_info_key(scope_id, pod_id), *POD_VIEW_FIELDS)
            infos = await pipe.execute()
        return {
            "pool_config": config or None,
            "pods": [
                {"pod_id": p, "phase": i[0], "deploy_ver": i[1], "pod_ip": i[2]}
                for p, i in zip(pods, infos, strict=True)
            ],
            "idle": sorted(idle),
            "deploys_in_flight": sum(placeholder_deadline(m) >= int(now) for m in deploying),
            "followers": sum(int(c["followers"] or 0) for c in cold),
            "deploy_lock_held": bool(leaders),
            "deploy_leader": leaders[0] if leaders else None,
            "cold_deploys": cold,
        }

    async def pod_info(self, pod_id: str) -> dict[str, str]:
        """The pod's info hash as stored (empty: not registered); its ``cluster`` field is
        absent for the process default. Its scope from the pod index."""
        scope_id = await self._state.scope_of_pod(pod_id)
        if scope_id is None:
            return {}
        return cast(dict[str, str], await self.redis.hgetall(pod_info_key(scope_id, pod_id)))

    async def foreign_pods(self) -> tuple[int, list[dict[str, Any]]]:
        """Reconcile's last report: how many were seen, and those it holds (sorted by
        namespace/pod)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(FOREIGN_COUNT_KEY)
            pipe.hgetall(FOREIGN_PODS_KEY)
            count, pods = await pipe.execute()
        return int(count or 0), [json.loads(pods[k]) for k in sorted(pods)]

    async def drain(self, pod_id: str) -> dict[str, Any] | None:
        """The pod's drain (None: none under way): state, trigger, deadline, since."""
        drain = await self._drains.drain_of(pod_id)
        return None if drain is None else _drain_view(drain)

    async def drains(self, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """How many pods are under a drain, and up to ``limit`` of them, soonest deadline
        first, each with its scope and the seconds left (Redis clock)."""
        pods = await self._drains.draining_pods()
        return len(pods), [_drain_view(d) for d in await self._drains.drains(pods[:limit])]

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return float(seconds) + micros / 1_000_000

    # --- gauges ----------------------------------------------------------------------------------

    async def pod_phases(self) -> dict[str, int]:
        """Registered pods by phase (in_use / idle / draining): O(pods), in slices."""
        counts: dict[str, int] = {"in_use": 0, "idle": 0}
        for pod in (await self._pods.pod_phases(await self._pods.all_pods())).values():
            if pod.phase:
                counts[pod.phase] = counts.get(pod.phase, 0) + 1
        return counts

    async def placeholders(self, scope_ids: list[str]) -> int:
        """Deploys in flight (placeholders) over the given scopes: one SCARD each, pipelined."""
        if not scope_ids:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in scope_ids:
                pipe.scard(scope_deploying_key(scope_id))
            return sum(int(n) for n in await pipe.execute())

    async def budget_used(self, rule_id: str | None = None) -> int:
        """Live units of the global budget (or of a rule's): pods + unexpired reservations."""
        return await self._state.budget.used(rule_id)

    async def foreign_pod_count(self) -> int:
        return int(await self.redis.get(FOREIGN_COUNT_KEY) or 0)


def _drain_view(drain: Drain) -> dict[str, Any]:
    return {
        "pod_id": drain.pod_id,
        "scope_id": drain.scope_id,
        "state": drain.state,
        "trigger": drain.trigger,
        "deadline": drain.deadline,
        "since": drain.since,
    }
