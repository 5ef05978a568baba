"""A scope's deploys in Redis: placeholders, the deploy lease (lock and pod record), the
follower room, and the prune of what a dead replica left. Keys from ``state.py``'s builders;
each script's reply decoded here, once, into ``state_values``.

The deploy lock holds the leader's token ``{owner}/{uuid}@{start}`` (``lock_token``): who
leads (a replica id, or ``reconcile``), and when its acquire started (Redis seconds), so a
follower knows that every pod the leader brings is registered at or after that
(``LeaseTake.holder_started``, ``DeployView.leader_started``).
"""

from __future__ import annotations

import math
import uuid
from typing import cast

from agent_runtime.resource_manager.models import WARM_TOKEN_PREFIX
from agent_runtime.resource_manager.state import (
    BUDGET_LIMITS_KEY,
    BUDGET_PODS_KEY,
    BUDGET_RULE_PREFIX,
    BUDGET_RULES_KEY,
    DEPLOY_RECORD_FIELDS,
    LEASED_SCOPES_KEY,
    PODS_ALL_KEY,
    SCOPE_PREFIX,
    ResourceState,
    deploy_lock_key,
    deploy_pod_key,
    placeholder_deadline,
    scope_config_key,
    scope_deploying_key,
    scope_followers_key,
    scope_pods_key,
)
from agent_runtime.resource_manager.state_values import (
    DeployView,
    LeasePrune,
    LeaseTake,
    OrphanPod,
    PlaceholderOutcome,
)

BATCH = 500  # members per SSCAN page
LEASE_PRUNE_BATCH = 20  # scopes per lease_prune call: ~8 commands, 15–30 µs a scope in Redis


def lock_token(owner: str, started: float) -> str:
    """A deploy lock's token: ``owner`` leads, its acquire started at ``started``."""
    return f"{owner}/{uuid.uuid4().hex}@{started!r}"


def warm_token() -> str:
    """A placeholder token of the warm pool's own deploys (autoscale): told from a route's by
    its prefix (``DeployView.warm``, ``InFlight.warm``)."""
    return f"{WARM_TOKEN_PREFIX}{uuid.uuid4().hex}"


def lock_started(token: str | None) -> float:
    """When a leader's acquire started (Redis seconds), from its token; inf when unknown."""
    _, at, started = (token or "").rpartition("@")
    try:
        return float(started) if at else math.inf
    except ValueError:
        return math.inf


def _lease_take(reply: list[str]) -> LeaseTake:
    if reply[0] == "follower":
        return LeaseTake(False, holder=reply[1], holder_started=lock_started(reply[1]))
    if len(reply) > 1:
        pod_id, namespace, created, uid, *cluster = reply[1:]
        orphan = OrphanPod(pod_id, namespace, float(created), uid, (cluster or [""])[0] or None)
        return LeaseTake(True, orphan=orphan)
    return LeaseTake(True)


def _placeholder(reply: list[str]) -> PlaceholderOutcome:
    if reply[0] == "ok":
        return PlaceholderOutcome(reply[1])
    return PlaceholderOutcome(None, reply[0], reply[1] if len(reply) > 1 else None)


class DeployState:
    """Placeholders, deploy leases and follower seats, over a ``ResourceState``'s client."""

    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self.pod_budget = state.pod_budget
        placeholders = ("_budget", "_placeholders")
        self._placeholder = state.script("placeholder", placeholders)
        self._drop_placeholder = state.script("drop_placeholder", "_budget")
        # the shared seat gate (lua_shared/seat_gate.lua; the session side's wait queue is
        # the same script), timed as the follower room's
        self._follower_gate = state.shared_script("seat_gate", label="deploy_follower_gate")
        self._lease_take = state.script("deploy_lease_take")
        self._lease_renew = state.script("deploy_lease", placeholders)
        self._lease_end = state.script("deploy_lease_end")
        self._lease_prune = state.script("lease_prune", placeholders)

    # --- placeholders --------------------------------------------------------------------------

    async def add_placeholder(self, scope_id: str, token: str, placeholder_ttl: int) -> str | None:
        """The placeholder member, or None (no config, max_pods or a pod budget reached)."""
        return (await self.try_placeholder(scope_id, token, placeholder_ttl)).member

    async def try_placeholder(
        self, scope_id: str, token: str, placeholder_ttl: int
    ) -> PlaceholderOutcome:
        reply = await self._placeholder(
            keys=[
                scope_config_key(scope_id),
                scope_pods_key(scope_id),
                scope_deploying_key(scope_id),
                BUDGET_PODS_KEY,
                BUDGET_RULES_KEY,
                BUDGET_LIMITS_KEY,
                LEASED_SCOPES_KEY,
            ],
            args=[token, placeholder_ttl, scope_id, BUDGET_RULE_PREFIX, self.pod_budget],
        )
        return _placeholder(reply)

    async def drop_placeholder(self, scope_id: str, member: str) -> None:
        """Give back a placeholder and its budget units (idempotent)."""
        await self._drop_placeholders(scope_id, "member", member)

    async def drop_placeholders_of(self, scope_id: str, token: str) -> int:
        """Placeholders taken with ``token`` (members ``{token}@{deadline}``), for a caller
        that never saw the member (its reply was lost). The set is small (≤ max_pods)."""
        return await self._drop_placeholders(scope_id, "token", token)

    async def _drop_placeholders(self, scope_id: str, mode: str, value: str) -> int:
        dropped = await self._drop_placeholder(
            keys=[scope_config_key(scope_id), scope_deploying_key(scope_id), BUDGET_PODS_KEY],
            args=[scope_id, BUDGET_RULE_PREFIX, mode, value],
        )
        return int(dropped)

    # --- deploy leases -------------------------------------------------------------------------

    async def take_deploy_lease(self, scope_id: str, token: str, lease: float) -> LeaseTake:
        """Lead the scope's deploy for ``lease`` seconds (renewed by ``renew_deploy_lease``),
        inheriting the pod of a leader whose lease lapsed (deploy_lease_take.lua)."""
        reply = await self._lease_take(
            keys=[deploy_lock_key(scope_id), deploy_pod_key(scope_id), PODS_ALL_KEY],
            args=[token, max(int(lease * 1000), 1)],
        )
        return _lease_take(reply)

    async def renew_deploy_lease(
        self,
        scope_id: str,
        placeholder_token: str,
        lock_token: str,
        lease: float,
        *,
        pod: tuple[str, str, str] | None = None,
        record_ttl: int = 0,
        cluster: str | None = None,
    ) -> str | None:
        """Renew a deploy's claim (its placeholder and, with ``lock_token``, the scope's deploy
        lock) for ``lease`` seconds; with ``pod`` (name, namespace, uid) also record the pod it
        created, in ``cluster`` (None: the process default). The placeholder's new member, or
        None: the claim is lost (deploy_lease.lua)."""
        status, *member = await self._lease_renew(
            keys=[
                scope_deploying_key(scope_id),
                scope_config_key(scope_id),
                scope_pods_key(scope_id),
                BUDGET_PODS_KEY,
                BUDGET_RULES_KEY,
                deploy_lock_key(scope_id),
                deploy_pod_key(scope_id),
                LEASED_SCOPES_KEY,
            ],
            args=[
                placeholder_token,
                lock_token,
                lease,
                scope_id,
                BUDGET_RULE_PREFIX,
                *(pod or ("", ""))[:2],
                record_ttl,
                pod[2] if pod else "",
                cluster or "",
            ],
        )
        return str(member[0]) if status == "ok" else None

    async def end_deploy_lease(
        self, scope_id: str, token: str, outcome: str, notice_seconds: float
    ) -> bool:
        """Give back the deploy lock and its pod record; ``outcome`` "failed" leaves a notice
        for the followers for ``notice_seconds`` (deploy_lease_end.lua)."""
        released = await self._lease_end(
            keys=[deploy_lock_key(scope_id), deploy_pod_key(scope_id)],
            args=[token, outcome, max(int(notice_seconds * 1000), 1)],
        )
        return bool(released)

    async def deploy_record(self, scope_id: str) -> OrphanPod | None:
        """The pod the scope's deploy leader recorded (not a failure notice), None without."""
        pod_id, namespace, created, uid, failed, cluster = cast(
            list[str | None],
            await self.redis.hmget(deploy_pod_key(scope_id), *DEPLOY_RECORD_FIELDS),
        )
        if failed or not pod_id:
            return None
        return OrphanPod(pod_id, namespace or "", float(created or 0), uid or "", cluster or None)

    async def deploy_view(self, scope_id: str) -> DeployView:
        """Leader, failure notice and live placeholders of the scope, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(deploy_lock_key(scope_id))
            pipe.hget(deploy_pod_key(scope_id), "failed")
            pipe.smembers(scope_deploying_key(scope_id))
            pipe.time()
            leader, failed, members, (seconds, _) = await pipe.execute()
        live = [m for m in members if placeholder_deadline(m) >= int(seconds)]
        warm = [m for m in live if m.startswith(WARM_TOKEN_PREFIX)]
        return DeployView(
            leader, bool(failed), len(warm) < len(live), bool(warm), lock_started(leader)
        )

    # --- follower seats ------------------------------------------------------------------------

    async def take_follower_seat(
        self, scope_id: str, member: str, hold_seconds: int, limit: int
    ) -> bool:
        seated = await self._follower_gate(
            keys=[scope_followers_key(scope_id), LEASED_SCOPES_KEY],
            args=[member, hold_seconds, limit, scope_id],
        )
        return bool(seated)

    async def leave_follower_seat(self, scope_id: str, member: str) -> None:
        await self.redis.zrem(scope_followers_key(scope_id), member)

    # --- what a dead replica left --------------------------------------------------------------

    async def prune_leases(self) -> LeasePrune:
        """Drop the follower seats and placeholders whose lease ran out (a replica that died
        left them) in every scope that took one, LEASE_PRUNE_BATCH scopes a script call
        (lease_prune.lua)."""
        scopes = [s async for s in self.redis.sscan_iter(LEASED_SCOPES_KEY, count=BATCH)]
        seats = placeholders = 0
        for i in range(0, len(scopes), LEASE_PRUNE_BATCH):
            dropped_seats, dropped_placeholders = await self._lease_prune(
                keys=[LEASED_SCOPES_KEY, BUDGET_PODS_KEY, PODS_ALL_KEY],
                args=[
                    SCOPE_PREFIX,
                    BUDGET_RULE_PREFIX,
                    deploy_lock_key(""),
                    *scopes[i : i + LEASE_PRUNE_BATCH],
                ],
            )
            seats += int(dropped_seats)
            placeholders += int(dropped_placeholders)
        return LeasePrune(seats, placeholders)
