"""Each scope's warm pool plan, as autoscale and reclaim need it: ``warm_policy`` fed with
what Redis and the session side measure. A static scope costs no read beyond what the jobs
read already (its plan is the min_idle_pods floor); a predictive one adds, per tick and in
slices, its demand (the session side's ``scope_demand``: arrival rates, live sessions, waiting
routes), its registered pods, its recent deploy times, and the installation's budget room once.
The routing rules' budgets are not read: the placeholder script refuses past them, and
autoscale stops a rule's scopes at the first refusal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, replace

from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.session_side import ARRIVAL_FAST_WINDOW, SessionSide
from agent_runtime.resource_manager.state_values import InFlight, PoolConfig
from agent_runtime.resource_manager.warm_policy import (
    DEFAULT_MARGIN,
    WarmInputs,
    WarmPlan,
    arrival_rate,
    deploy_time_of,
    plan,
)

NO_DEPLOYS = InFlight(warm=0, cold=0)


class WarmTargets:
    def __init__(
        self, *, jobs_state: PoolJobsState, sessions: SessionSide, margin: float = DEFAULT_MARGIN
    ) -> None:
        self._jobs_state = jobs_state
        self._sessions = sessions
        self._margin = margin

    async def plans(
        self,
        configs: Mapping[str, PoolConfig],
        warm_of: Mapping[str, Mapping[str, float]],
        in_flight: Mapping[str, InFlight],
    ) -> dict[str, WarmPlan]:
        """Each scope's plan. ``warm_of``: its warm pods of the current version → idle_since;
        ``in_flight``: its live placeholders."""
        predictive = [s for s, c in configs.items() if c.warm_pool == "predictive"]
        measured = await self._measured(predictive)
        plans: dict[str, WarmPlan] = {}
        for n, (scope_id, config) in enumerate(configs.items()):
            if n % 500 == 499:
                await asyncio.sleep(0)  # the jobs run in the serving process: let routes in
            warm = len(warm_of.get(scope_id, {}))
            deploys = in_flight.get(scope_id, NO_DEPLOYS)
            inputs = WarmInputs(
                pod_concurrency=config.pod_concurrency,
                pods=warm,
                idle_pods=warm,
                sessions=0,
                in_flight=deploys.total,
                warm_in_flight=deploys.warm,
                queued=0,
                min_idle_pods=config.min_idle_pods,
                max_pods=config.max_pods,
                pod_ttl=config.pod_ttl,
            )
            if (m := measured.get(scope_id)) is not None:
                inputs = replace(
                    inputs, pods=max(m.pods, warm), sessions=m.sessions, queued=m.queued,
                    rate=m.rate, departure_rate=m.departure_rate, deploy_time=m.deploy_time,
                    budget_room=m.budget_room,
                )  # fmt: skip
            plans[scope_id] = plan(config.warm_pool, inputs, margin=self._margin)
        return plans

    async def _measured(self, scope_ids: list[str]) -> dict[str, _Measured]:
        if not scope_ids:
            return {}
        demand = await self._sessions.scope_demand(scope_ids)
        pods = await self._jobs_state.pod_counts_of(scope_ids)
        times = await self._jobs_state.deploy_times_of(scope_ids)
        room = await self._jobs_state.budget_room()
        filled: dict[str, _Measured] = {}
        for scope_id in scope_ids:
            seen = demand.get(scope_id)
            if seen is None:
                continue
            filled[scope_id] = _Measured(
                pods=pods.get(scope_id, 0),
                sessions=seen.sessions,
                queued=seen.queued,
                rate=arrival_rate(seen.arrivals_fast, seen.arrivals_slow, ARRIVAL_FAST_WINDOW),
                departure_rate=seen.arrivals_slow,  # steady state: as many end as arrive
                deploy_time=deploy_time_of(times.get(scope_id, [])),
                budget_room=room,
            )
        return filled


@dataclass(frozen=True, slots=True)
class _Measured:
    """A predictive scope's measurements."""

    pods: int
    sessions: int
    queued: int
    rate: float
    departure_rate: float
    deploy_time: float
    budget_room: int
