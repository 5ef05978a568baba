"""The demand a predictive warm pool is sized by, read in slices: each scope's arrival rates
(``scope:{sid}:arrivals``, kept by route_place.lua at no extra round trip), live sessions and
routes waiting for a slot: one ``scope_demand.lua`` call per scope (its four keys, one slot on
a Redis Cluster), pipelined a slice at a time; key names from ``state.py``'s builders, the
reply decoded here, once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from agent_runtime import lua
from agent_runtime.resource_manager.session_side import (
    ARRIVAL_FAST_WINDOW,
    ARRIVAL_SLOW_WINDOW,
    ScopeDemand,
)
from agent_runtime.session_manager.state import (
    KEYS_PRELUDE,
    ScriptCall,
    pipelined,
    scope_arrivals_key,
    scope_reserved_key,
    scope_sessions_key,
    scope_waiters_key,
)

DEMAND_BATCH = 200  # scope_demand calls per pipeline (~4 commands each)
_FIELDS = 5  # per scope: fast, slow, at, sessions, queued


class DemandState:
    """``scope_demand`` over a client (decode_responses)."""

    def __init__(self, redis: Redis, *, observe: lua.ScriptObserver | None = None) -> None:
        self.redis = redis
        self._scope_demand = lua.register(
            redis,
            "agent_runtime.session_manager",
            "scope_demand",
            prelude=KEYS_PRELUDE,
            observe=observe,
        )

    async def scope_demand(self, scope_ids: Sequence[str]) -> dict[str, ScopeDemand]:
        """Each scope's demand, its rates decayed to Redis' now (a rate not updated for a
        while has fallen as the EWMA says)."""
        demand: dict[str, ScopeDemand] = {}
        for i in range(0, len(scope_ids), DEMAND_BATCH):
            batch = list(scope_ids[i : i + DEMAND_BATCH])
            calls: list[ScriptCall] = [
                (
                    self._scope_demand,
                    [
                        scope_arrivals_key(scope_id),
                        scope_sessions_key(scope_id),
                        scope_waiters_key(scope_id),
                        scope_reserved_key(scope_id),
                    ],
                    [],
                )
                for scope_id in batch
            ]
            replies = await pipelined(self.redis, calls)
            for scope_id, reply in zip(batch, replies, strict=True):
                now = int(reply[0]) + int(reply[1]) / 1_000_000
                demand[scope_id] = _demand_of(reply[2 : 2 + _FIELDS], now)
        return demand


def _demand_of(values: list[Any], now: float) -> ScopeDemand:
    fast, slow, at, sessions, queued = values
    since = max(now - float(at), 0.0) if at else 0.0
    return ScopeDemand(
        arrivals_fast=_decayed(fast, since, ARRIVAL_FAST_WINDOW),
        arrivals_slow=_decayed(slow, since, ARRIVAL_SLOW_WINDOW),
        sessions=int(sessions),
        queued=int(queued),
    )


def _decayed(rate: Any, since: float, window: float) -> float:
    return float(rate) * math.exp(-since / window) if rate else 0.0
