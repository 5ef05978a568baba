"""A scope's deploys in Redis: placeholders, the cold deploys (each its own lease: lock and pod
record, and its own follower room, indexed per scope), the claim that decides follow or lead,
and the prune of what a dead replica left. Keys from ``state.py``'s builders;
each script's reply decoded here, once, into ``state_values``.

The deploy lock holds the leader's token ``{owner}/{demand}/{uuid}@{start}`` (``lock_token``):
who leads (a replica id, or ``reconcile``), the demand it serves (the route's request id, which
is not its deploy's id after a takeover: deploy_claim.lua joins a demand's own deploy by it),
and when its acquire started (Redis seconds), so a reader knows which replica leads a deploy.
"""

from __future__ import annotations

import math
import uuid
from typing import cast
from urllib.parse import quote

from agent_runtime.resource_manager.budget_state import reservation_unit
from agent_runtime.resource_manager.models import WARM_TOKEN_PREFIX
from agent_runtime.resource_manager.state import (
    DEPLOY_RECORD_FIELDS,
    ResourceState,
    deploy_lock_key,
    deploy_lock_prefix,
    deploy_pod_key,
    scope_cold_deploys_key,
    scope_config_key,
    scope_deploying_key,
    scope_followers_key,
    scope_key_head,
    scope_pods_key,
)
from agent_runtime.resource_manager.state_values import (
    DeployClaim,
    DeployView,
    LeasePrune,
    LeaseRenewal,
    LeaseTake,
    OrphanPod,
    PlaceholderOutcome,
)
from agent_runtime.scope_buckets import BUCKETS

LEASE_PRUNE_BATCH = 50  # due scopes a bucket a pass, one lease_prune each (~8 commands)
LIVE_DEPLOY_RECHECK = 5  # seconds: the next look at a scope whose cold deploy is live


def lock_token(owner: str, started: float, demand: str = "") -> str:
    """A deploy lock's token: ``owner`` leads for ``demand`` ("" for none: reconcile), its
    acquire started at ``started``. The demand is percent-encoded (no "/" or "@" in it), so
    that deploy_claim.lua reads it back as the segment before the uuid."""
    return f"{owner}/{quote(demand, safe='')}/{uuid.uuid4().hex}@{started!r}"


def warm_token() -> str:
    """A placeholder token of the warm pool's own deploys (autoscale): told from a route's by
    its prefix (``InFlight.warm``)."""
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
        return LeaseTake(True, orphan=_orphan(reply[1:]))
    return LeaseTake(True)


def _orphan(fields: list[str]) -> OrphanPod:
    pod_id, namespace, created, uid, *cluster = fields
    return OrphanPod(pod_id, namespace, float(created), uid, (cluster or [""])[0] or None)


def _claim(reply: list[str]) -> DeployClaim:
    action, *rest = reply
    if action == "follow":
        return DeployClaim(action, rest[0], holder=rest[1])
    if action == "lead":
        orphan = _orphan(rest[2:]) if len(rest) > 2 else None
        return DeployClaim(action, rest[0], orphan=orphan, placeholder=rest[1])
    if action == "budget_reached":
        return DeployClaim(action, budget=rest[0])
    if action == "reserve":
        return DeployClaim(action, coming=rest[0] == "1")
    return DeployClaim(action)


def _placeholder(reply: list[str]) -> PlaceholderOutcome:
    if reply[0] == "ok":
        return PlaceholderOutcome(reply[1])
    return PlaceholderOutcome(None, reply[0], reply[1] if len(reply) > 1 else None)


class DeployState:
    """Placeholders, deploy leases and follower seats, over a ``ResourceState``'s client."""

    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self.state = state
        self.budget = state.budget
        self._claim = state.script("deploy_claim", "_placeholders")
        self._lease_take = state.script("deploy_lease_take")
        self._lease_renew = state.script("deploy_lease", "_placeholders")
        self._lease_end = state.script("deploy_lease_end")
        self._lease_prune = state.script("lease_prune", "_placeholders")
        self._follower_leave = state.script("follower_leave")

    # --- placeholders --------------------------------------------------------------------------

    async def add_placeholder(self, scope_id: str, token: str, placeholder_ttl: int) -> str | None:
        """The placeholder member, or None (no config, max_pods or a pod budget reached)."""
        return (await self.try_placeholder(scope_id, token, placeholder_ttl)).member

    async def try_placeholder(
        self, scope_id: str, token: str, placeholder_ttl: int
    ) -> PlaceholderOutcome:
        """A placeholder with its budget unit (``ResourceState.reserve_placeholder``; the
        scope's link and the rules' limits as they are)."""
        return await self.state.reserve_placeholder(scope_id, token, placeholder_ttl)

    async def drop_placeholder(self, scope_id: str, member: str) -> None:
        """Give back a placeholder and its budget unit (idempotent)."""
        await self.state.drop_placeholders(scope_id, "member", member)

    async def drop_placeholders_of(self, scope_id: str, token: str) -> int:
        """Placeholders taken with ``token`` (members ``{token}@{deadline}``), for a caller
        that never saw the member (its reply was lost), and the token's budget unit. The set
        is small (≤ max_pods)."""
        return await self.state.drop_placeholders(scope_id, "token", token)

    # --- cold deploys: the claim, each deploy's lease ------------------------------------------

    async def claim_deploy(
        self,
        scope_id: str,
        deploy_id: str,
        *,
        token: str,
        lease: float,
        placeholder_token: str,
        member: str,
        seat_hold: float,
        room_ttl: int,
        concurrency: int,
        pod_concurrency: int,
        rule: tuple[str, int] | None = None,
    ) -> DeployClaim:
        """Follow a deploy in flight with a free seat, or reserve a slot (placeholder
        ``placeholder_token``, within max_pods and the pod budgets) and take over a lapsed
        deploy or lead a new one as ``deploy_id`` within ``concurrency`` live deploys; a
        deploy's room holds ``pod_concurrency`` - 1 followers (deploy_claim.lua). Asked first
        without a budget unit: only where it would lead with a new placeholder is the unit
        reserved (budget_reserve.lua, another slot) and the claim asked again; the unit is
        given back unless the claim then leads (the placeholder's owner renews it, the pod's
        registration confirms it)."""

        async def claim(reserved: bool) -> DeployClaim:
            reply = await self._claim(
                keys=[
                    scope_cold_deploys_key(scope_id),
                    scope_deploying_key(scope_id),
                    scope_config_key(scope_id),
                    scope_pods_key(scope_id),
                ],
                args=[
                    deploy_lock_prefix(scope_id),
                    scope_key_head(scope_id),
                    deploy_id,
                    token,
                    max(int(lease * 1000), 1),
                    placeholder_token,
                    member,
                    seat_hold,
                    room_ttl,
                    concurrency,
                    scope_id,
                    pod_concurrency,
                    math.ceil(lease),
                    "1" if reserved else "0",
                ],
            )
            return _claim(reply)

        outcome = await claim(False)
        if outcome.action == "reserve":
            unit = reservation_unit(scope_id, placeholder_token)
            refused = await self.budget.reserve(scope_id, unit, lease, rule=rule)
            if refused is not None:  # a placeholder live: a pod may still come
                outcome = (
                    DeployClaim("coming")
                    if outcome.coming
                    else DeployClaim("budget_reached", budget=refused)
                )
            else:
                try:
                    outcome = await claim(True)
                finally:
                    if outcome.action != "lead":
                        await self.budget.release(scope_id, unit)
        if outcome.action in ("lead", "follow"):  # a placeholder, a lock or a seat
            await self.state.mark_leased(scope_id)
        return outcome

    async def take_deploy_lease(
        self, scope_id: str, deploy_id: str, token: str, lease: float
    ) -> LeaseTake:
        """Lead one deploy of the scope for ``lease`` seconds (renewed by
        ``renew_deploy_claim``), inheriting the pod of a leader whose lease lapsed
        (deploy_lease_take.lua: reconcile's way to a dead leader's pod)."""
        reply = await self._lease_take(
            keys=[
                deploy_lock_key(scope_id, deploy_id),
                deploy_pod_key(scope_id, deploy_id),
                scope_pods_key(scope_id),
            ],
            args=[token, max(int(lease * 1000), 1)],
        )
        return _lease_take(reply)

    async def renew_deploy_claim(
        self,
        scope_id: str,
        placeholder_token: str,
        lock_token: str,
        lease: float,
        *,
        deploy_id: str = "",
        pod: tuple[str, str, str] | None = None,
        record_ttl: int = 0,
        cluster: str | None = None,
    ) -> LeaseRenewal:
        """Renew a deploy's claim (its placeholder and, with ``lock_token``, the lock of cold
        deploy ``deploy_id``) for ``lease`` seconds; with ``pod`` (name, namespace, uid) also
        record the pod it created, in ``cluster`` (None: the process default). Its ``member``:
        the placeholder's new member, or None when the claim is lost; ``lost`` says why: "taken"
        (another leader holds or held it) or "no_room" (nobody does; no slot for it)."""
        status, *rest = await self._lease_renew(
            keys=[
                scope_deploying_key(scope_id),
                scope_config_key(scope_id),
                scope_pods_key(scope_id),
                deploy_lock_key(scope_id, deploy_id),
                deploy_pod_key(scope_id, deploy_id),
                scope_cold_deploys_key(scope_id),
            ],
            args=[
                placeholder_token,
                lock_token,
                lease,
                *(pod or ("", ""))[:2],
                record_ttl,
                pod[2] if pod else "",
                cluster or "",
                deploy_id,
            ],
        )
        unit = reservation_unit(scope_id, placeholder_token)
        if status == "ok":
            await self.budget.renew(scope_id, unit, lease)  # the unit lives as the lease
            await self.state.mark_leased(scope_id)  # taken again after a prune: looked at
            return LeaseRenewal(str(rest[0]))
        await self.budget.release(scope_id, unit)  # the placeholder is gone: its unit too
        return LeaseRenewal(None, str(rest[0]) if rest else "taken")

    async def end_deploy_lease(
        self, scope_id: str, deploy_id: str, token: str, outcome: str, notice_seconds: float
    ) -> bool:
        """Give back a deploy's lock; ``outcome`` "ok" keeps its record (the registered pod,
        for its followers) and "failed" leaves a notice, each for ``notice_seconds``; "done"
        drops the record and the index entry (reconcile settled the pod); "none" gives back
        only the lock (the record stays for a taker) (deploy_lease_end.lua)."""
        released = await self._lease_end(
            keys=[
                deploy_lock_key(scope_id, deploy_id),
                deploy_pod_key(scope_id, deploy_id),
                scope_cold_deploys_key(scope_id),
            ],
            args=[token, outcome, max(int(notice_seconds * 1000), 1), deploy_id],
        )
        return bool(released)

    async def cold_deploys(self, scope_id: str) -> list[str]:
        """The scope's cold deploys (live, or lapsed with a pod to take over): at most its
        deploy concurrency and the few whose leaders died."""
        return cast(list[str], await self.redis.zrange(scope_cold_deploys_key(scope_id), 0, -1))

    async def deploy_records(self, scope_id: str) -> dict[str, OrphanPod]:
        """The pods the scope's cold deploys recorded (not failure notices), by deploy id."""
        ids = await self.cold_deploys(scope_id)
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for deploy_id in ids:
                pipe.hmget(deploy_pod_key(scope_id, deploy_id), *DEPLOY_RECORD_FIELDS)
            rows = cast(list[list[str | None]], await pipe.execute())
        records = {}
        for deploy_id, (pod_id, namespace, created, uid, failed, cluster) in zip(
            ids, rows, strict=True
        ):
            if pod_id and not failed:
                records[deploy_id] = OrphanPod(
                    pod_id, namespace or "", float(created or 0), uid or "", cluster or None
                )
        return records

    async def deploy_view(self, scope_id: str, deploy_id: str) -> DeployView:
        """One deploy's leader, failure notice and recorded pod, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(deploy_lock_key(scope_id, deploy_id))
            pipe.hmget(deploy_pod_key(scope_id, deploy_id), "pod_id", "failed")
            leader, (pod_id, failed) = await pipe.execute()
        return DeployView(leader, bool(failed), pod_id)

    # --- follower seats ------------------------------------------------------------------------

    async def renew_follower_seat(
        self, scope_id: str, deploy_id: str, member: str, hold_seconds: float
    ) -> None:
        """Move a seat's deadline (one ZADD XX: a seat the prune dropped is not taken again,
        the claim alone seats)."""
        seconds, micros = await self.redis.time()
        deadline = seconds + micros / 1_000_000 + hold_seconds
        await self.redis.zadd(scope_followers_key(scope_id, deploy_id), {member: deadline}, xx=True)

    async def followers_waiting(self, scope_id: str, deploy_id: str) -> bool:
        """Whether a live seat is taken in the deploy's room."""
        seconds, micros = await self.redis.time()
        key = scope_followers_key(scope_id, deploy_id)
        return bool(await self.redis.zcount(key, seconds + micros / 1_000_000, "+inf"))

    async def leave_follower_seat(
        self, scope_id: str, deploy_id: str, member: str, *, served: bool = False
    ) -> None:
        """Give back a seat; ``served``: the follower leaves with the deploy's pod, and keeps
        its place in the room's count (follower_leave.lua)."""
        await self._follower_leave(
            keys=[scope_followers_key(scope_id, deploy_id), deploy_pod_key(scope_id, deploy_id)],
            args=[member, "1" if served else "0"],
        )

    # --- what a dead replica left --------------------------------------------------------------

    async def prune_leases(self, *, walk: list[str] | None = None) -> LeasePrune:
        """Drop the follower seats and placeholders whose lease ran out (a replica that died
        left them) in every scope of the leased index whose time has come, bucket by bucket
        (LEASE_PRUNE_BATCH scopes a bucket a pass, one lease_prune call each), and settle each
        (next look, or out of the index). ``walk``: scopes to look at besides, whatever the
        index says (the job's slow walk, a slice a pass): one with a lease left is marked, so
        a mark lost with a crashed replica is found."""
        seats = placeholders = 0
        for bucket in range(BUCKETS):
            for scope_id, seen in await self.state.leased.due(bucket, LEASE_PRUNE_BATCH):
                dropped_seats, dropped_placeholders, next_look = await self._prune_scope(scope_id)
                seats, placeholders = seats + dropped_seats, placeholders + dropped_placeholders
                await self.state.leased.settle(scope_id, seen, next_look)
        for scope_id in walk or ():
            dropped_seats, dropped_placeholders, next_look = await self._prune_scope(scope_id)
            seats, placeholders = seats + dropped_seats, placeholders + dropped_placeholders
            if next_look is not None:
                await self.state.leased.mark(scope_id, next_look)
        return LeasePrune(seats, placeholders)

    async def _prune_scope(self, scope_id: str) -> tuple[int, int, float | None]:
        dropped_seats, dropped_placeholders, next_look = await self._lease_prune(
            keys=[
                scope_deploying_key(scope_id),
                scope_cold_deploys_key(scope_id),
                scope_pods_key(scope_id),
            ],
            args=[
                deploy_lock_prefix(scope_id),
                scope_key_head(scope_id),
                LIVE_DEPLOY_RECHECK,
            ],
        )
        return (
            int(dropped_seats),
            int(dropped_placeholders),
            float(next_look) if next_look else None,
        )
