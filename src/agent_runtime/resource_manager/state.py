"""Resource manager state in Redis: the only module that knows the ``resource_manager:`` keys.

Key table: contract §4 and ``docs/design/hld.md`` §5. Every change of a pool is one Lua
script from ``lua/`` (registered once, called by EVALSHA); plain commands are used only for
reads, for single-command changes (SREM out of the idle pool, the per-pod fail counter) and
for the pool config (one HSET).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio import Redis

from agent_runtime import lua
from agent_runtime.config import RM_KEY_PREFIX as P
from agent_runtime.errors import RequestIdReused
from agent_runtime.resource_manager.models import WARM_TOKEN_PREFIX

SCOPE_PREFIX = f"{P}resource:scope:"
POD_PREFIX = f"{P}resource:pod:"
PODS_ALL_KEY = f"{P}resource:pods:all"
# Not in the contract (nothing outside reads it): every scope with a pool config, so the jobs
# find them with an SSCAN of their own set instead of a SCAN of the whole keyspace (at 100k
# sessions ~150k keys, 300 round trips a tick). Written with the config; reconcile adds any
# config the index lacks (an upgrade from a version without it, a config written by hand).
SCOPES_KEY = f"{P}resource:scopes"
SCOPE_CONFIG_PATTERN = f"{SCOPE_PREFIX}*:config"
# Not in the contract: scopes that took a follower seat or a placeholder since the prune job
# last found them empty, where a dead replica's leftovers can be (lease_prune.lua).
LEASED_SCOPES_KEY = f"{P}resource:leased_scopes"
# Pod budgets (docs/spec/resource-manager.md "Pod budgets"): ZSETs of units, a registered pod
# (score +inf) or a placeholder "{sid}:{member}" (score = its deadline), changed only by the
# scripts that add or remove the pod or placeholder itself.
BUDGET_PODS_KEY = f"{P}budget:pods"
BUDGET_RULE_PREFIX = f"{P}budget:rule:"
BUDGET_RULES_KEY = f"{P}budget:rules"  # SET: rule ids that have a units ZSET (for reconcile)
BUDGET_LIMITS_KEY = f"{P}budget:rule_limits"  # HASH: rule id -> its pod budget (>= 1)
DEFAULT_POD_BUDGET = 1000
# Reconcile's report of pods with our labels that are not provably ours (foreign_report.lua)
FOREIGN_PODS_KEY = f"{P}resource:foreign_pods"
FOREIGN_COUNT_KEY = f"{P}resource:foreign_pods:count"
IDEM_TTL = 60
# The jobs' reads come in slices, a round trip each, so no slice holds the loop for long
# and no call holds Redis (single-threaded: a route waits behind it) for more than ~0.5 ms.
BATCH = 500  # keys per MGET / SADD, members per SSCAN page (~0.3 ms in Redis)
SCRIPT_BATCH = 200  # keys per pod_fields / read_many call (~2–3 µs each inside Redis)
# reconcile's budget repair: a scope costs ~3 commands + 2 per pod and placeholder, a unit ~4
FILL_BATCH = 25  # scopes per budget_fill call
PRUNE_BATCH = 100  # units per budget_prune call
LEASE_PRUNE_BATCH = 20  # scopes per lease_prune call: ~8 commands, 15–30 µs a scope in Redis


def scope_config_key(scope_id: str) -> str:
    return f"{SCOPE_PREFIX}{scope_id}:config"


def scope_pods_key(scope_id: str) -> str:
    return f"{SCOPE_PREFIX}{scope_id}:pods"


def scope_idle_key(scope_id: str) -> str:
    return f"{SCOPE_PREFIX}{scope_id}:idle"


def scope_deploying_key(scope_id: str) -> str:
    return f"{SCOPE_PREFIX}{scope_id}:deploying"


def scope_followers_key(scope_id: str) -> str:
    return f"{SCOPE_PREFIX}{scope_id}:deploy_followers"


def budget_rule_pods_key(rule_id: str) -> str:
    return f"{BUDGET_RULE_PREFIX}{rule_id}:pods"


def scope_config_gen_key(scope_id: str) -> str:
    """The config_sync generation that last wrote the scope's pool config (not in the
    contract: the config hash keeps exactly the contract's fields)."""
    return f"{SCOPE_PREFIX}{scope_id}:config_gen"


def pod_info_key(pod_id: str) -> str:
    return f"{POD_PREFIX}{pod_id}:info"


def info_cluster(info: dict[str, str]) -> str | None:
    """The cluster of a pod's info (``pod_info``): its ``cluster`` field, None for the process
    default (the field absent, as in every info written before pods recorded their cluster)."""
    return info.get("cluster") or None


def pod_idle_since_key(pod_id: str) -> str:
    return f"{POD_PREFIX}{pod_id}:idle_since"


def pod_health_fails_key(pod_id: str) -> str:
    return f"{POD_PREFIX}{pod_id}:health_fails"


def deploy_lock_key(scope_id: str) -> str:
    return f"{P}lock:rm:deploy:{scope_id}"


def deploy_pod_key(scope_id: str) -> str:
    """The deploy leader's pod, recorded once created (its name, namespace, uid and cluster,
    under the leader's token), or the notice of a failed deploy (not in the contract)."""
    return f"{SCOPE_PREFIX}{scope_id}:deploy_pod"


def placeholder_token(member: str) -> str:
    """The token of a placeholder member ``{token}@{deadline}``."""
    return member.rpartition("@")[0]


def placeholder_deadline(member: str) -> float:
    """Redis seconds until which a placeholder counts (0 for a malformed one: expired)."""
    try:
        return float(member.rpartition("@")[2])
    except ValueError:
        return 0.0


def registered_channel(scope_id: str) -> str:
    """Pub/sub: a pod of the scope was registered (payload: pod id). Wakes deploy followers."""
    return f"{SCOPE_PREFIX}{scope_id}:registered"


REGISTERED_PATTERN = f"{SCOPE_PREFIX}*:registered"


def idem_key(request_id: str) -> str:
    """The acquire result for 60 s, bound to its scope (``scope_id`` in the JSON)."""
    return f"{P}idem:{request_id}"


def _reused(request_id: str) -> RequestIdReused:
    return RequestIdReused(f"acquire {request_id}: the request_id got a pod of another scope")


@dataclass(frozen=True, slots=True)
class AcquireOutcome:
    """What the ``acquire`` script decided."""

    action: str  # cached | reuse | no_config | max_reached | budget_reached | need_deploy
    pod_id: str | None = None
    pod_sse_url: str | None = None
    deploy_ver: str | None = None
    placeholder: str | None = None
    budget: str | None = None  # budget_reached: "global" or "rule"


@dataclass(frozen=True, slots=True)
class OrphanPod:
    """A pod a deploy leader created under a lease that lapsed: inherited by the next leader."""

    pod_id: str
    namespace: str
    created: float  # Redis seconds
    uid: str  # the incarnation the leader created ("" from a record that names none)
    cluster: str | None = None  # where it was created (None: the process default)


@dataclass(frozen=True, slots=True)
class LeaseTake:
    """What ``deploy_lease_take`` decided."""

    leader: bool
    holder: str | None = None  # a follower: the live leader's token
    orphan: OrphanPod | None = None


@dataclass(frozen=True, slots=True)
class DeployView:
    """A scope's deploy as a follower sees it: the leader (its lock token), a failure notice,
    and whether live placeholders of cold deploys (routes) or warm ones (the pool) exist."""

    leader: str | None
    failed: bool
    cold: bool
    warm: bool


@dataclass(frozen=True, slots=True)
class PlaceholderOutcome:
    """What the ``placeholder`` script decided: a member, or why not."""

    member: str | None
    refused: str | None = None  # no_config | max_reached | budget_reached
    budget: str | None = None  # budget_reached: "global" or "rule"


@dataclass(frozen=True, slots=True)
class AdoptOutcome:
    """What the ``adopt`` script decided."""

    action: str  # adopted | known | old_version | max_reached | budget_reached
    detail: str | None = None  # adopted: configured | unconfigured; budget_reached: which

    @property
    def kept(self) -> bool:
        """The pod is registered now (adopted, or already was)."""
        return self.action in ("adopted", "known")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    min_idle_pods: int
    max_pods: int
    pod_ttl: int
    pod_concurrency: int
    deploy_ver: str | None
    pod_spec: dict[str, Any] | None
    budget_rule: str = ""  # the rule whose pod budget the scope's pods count against


def _pairs(flat: list[str]) -> dict[str, str]:
    """A hash as a script returns it (field, value, field, value ...) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _pool_config(raw: dict[str, str]) -> PoolConfig | None:
    if not raw:
        return None
    spec = raw.get("pod_spec_json")
    return PoolConfig(
        min_idle_pods=int(raw.get("min_idle_pods", 0)),
        max_pods=int(raw.get("max_pods", 0)),
        pod_ttl=int(raw.get("pod_ttl", 0)),
        pod_concurrency=int(raw.get("pod_concurrency", 1)),
        deploy_ver=raw.get("deploy_ver"),
        pod_spec=_parsed_spec(spec) if spec else None,
        budget_rule=raw.get("budget_rule", ""),
    )


@functools.lru_cache(maxsize=4096)
def _parsed_spec(raw: str) -> dict[str, Any]:
    """A pod spec's JSON, parsed once per distinct text: the jobs read every scope's config
    every second and scopes of one template share it (1k parses were the longest loop slice
    of a tick). The dict is shared: read it, never change it."""
    return cast(dict[str, Any], json.loads(raw))


def _registration_keys(scope_id: str, pod_id: str) -> list[str]:
    """What registering a pod writes: KEYS[1..9] of register.lua and adopt.lua alike."""
    return [
        pod_info_key(pod_id),
        scope_pods_key(scope_id),
        PODS_ALL_KEY,
        scope_deploying_key(scope_id),
        scope_idle_key(scope_id),
        pod_idle_since_key(pod_id),
        scope_config_key(scope_id),
        BUDGET_PODS_KEY,
        BUDGET_RULES_KEY,
    ]


class ResourceState:
    """Typed operations on the resource manager's Redis keys (client with decode_responses)."""

    def __init__(
        self,
        redis: Redis,
        *,
        observe: lua.ScriptObserver | None = None,
        pod_budget: int = DEFAULT_POD_BUDGET,
    ) -> None:
        self.redis = redis
        self.pod_budget = pod_budget  # the installation's: pods + placeholders of all scopes
        pkg = "agent_runtime.resource_manager"

        def script(name: str, prelude: str | tuple[str, ...] | None = None) -> Any:
            return lua.register(redis, pkg, name, prelude=prelude, observe=observe)

        placeholders = ("_budget", "_placeholders")
        self._acquire = script("acquire", placeholders)
        self._placeholder = script("placeholder", placeholders)
        self._drop_placeholder = script("drop_placeholder", "_budget")
        self._register = script("register", "_budget")
        self._release = script("release")
        self._purge = script("purge", "_budget")
        self._budget_fill = script("budget_fill", "_budget")
        self._budget_prune = script("budget_prune", "_budget")
        self._follower_gate = script("deploy_follower_gate")
        self._lease_take = script("deploy_lease_take")
        self._lease_renew = script("deploy_lease", placeholders)
        self._lease_end = script("deploy_lease_end")
        self._lease_prune = script("lease_prune", placeholders)
        self._pod_fields = script("pod_fields")
        self._read_many_script = script("read_many")
        self._pool_config_script = script("pool_config")
        self._scope_expire = script("scope_expire")
        self._adopt = script("adopt", placeholders)
        self._foreign_report = script("foreign_report")

    # --- pool config ---------------------------------------------------------------------------

    async def write_pool_config(
        self,
        scope_id: str,
        pool_config: dict[str, int],
        *,
        deploy_ver: str | None = None,
        pod_spec: dict[str, Any] | None = None,
        generation: int | None = None,
    ) -> bool:
        """One HSET: pool parameters, and with a pod spec also its version (atomic together);
        the scope joins the index in the same script (pool_config.lua). With a
        ``generation`` (config_sync's), refused (False) when a newer config_sync already
        wrote the config: overlapping propagations converge to the later one."""
        fields: dict[str, str] = {k: str(int(v)) for k, v in pool_config.items()}
        if pod_spec is not None:
            assert deploy_ver is not None
            fields["deploy_ver"] = deploy_ver
            fields["pod_spec_json"] = json.dumps(pod_spec, sort_keys=True, separators=(",", ":"))
        flat = [x for kv in fields.items() for x in kv]
        written = await self._pool_config_script(
            keys=[scope_config_key(scope_id), SCOPES_KEY, scope_config_gen_key(scope_id)],
            args=[scope_id, "" if generation is None else generation, *flat],
        )
        return bool(written)

    async def expire_scope(self, scope_id: str) -> bool:
        """The scope's pool keys leave Redis if nothing of it is left (scope_expire.lua);
        True when gone (now or already)."""
        gone = await self._scope_expire(
            keys=[
                scope_config_key(scope_id),
                scope_pods_key(scope_id),
                scope_idle_key(scope_id),
                scope_deploying_key(scope_id),
                scope_followers_key(scope_id),
                deploy_lock_key(scope_id),
                SCOPES_KEY,
                scope_config_gen_key(scope_id),
            ],
            args=[scope_id],
        )
        return bool(gone)

    async def pool_config(self, scope_id: str) -> PoolConfig | None:
        return _pool_config(
            cast(dict[str, str], await self.redis.hgetall(scope_config_key(scope_id)))
        )

    async def pool_configs(self, scope_ids: list[str]) -> dict[str, PoolConfig]:
        """``pool_config`` of many scopes (those without one left out), pipelined."""
        raws = await self._read_many([scope_config_key(s) for s in scope_ids], "HGETALL")
        return {
            scope_id: config
            for scope_id, flat in zip(scope_ids, raws, strict=True)
            if (config := _pool_config(_pairs(flat))) is not None
        }

    async def scopes_with_config(self) -> list[str]:
        """Every scope with a pool config: an SSCAN of the index (see SCOPES_KEY)."""
        return [s async for s in self.redis.sscan_iter(SCOPES_KEY, count=BATCH)]

    async def index_scopes(self) -> int:
        """Add to the index every scope whose config it lacks (a SCAN of the keyspace, never
        KEYS: run by reconcile, not by every tick); returns how many were added."""
        prefix, suffix = len(SCOPE_PREFIX), len(":config")
        found = [
            key[prefix:-suffix]
            async for key in self.redis.scan_iter(match=SCOPE_CONFIG_PATTERN, count=BATCH)
        ]
        added = 0
        for i in range(0, len(found), BATCH):
            added += int(await self.redis.sadd(SCOPES_KEY, *found[i : i + BATCH]))
        return added

    # --- scripts -------------------------------------------------------------------------------

    async def acquire(
        self,
        scope_id: str,
        request_id: str,
        token: str,
        placeholder_ttl: int,
        *,
        rule_id: str = "",
        rule_pod_budget: int = 0,
    ) -> AcquireOutcome:
        """``rule_id``: the rule the scope resolves through now (its units follow it there);
        ``rule_pod_budget``: that rule's budget, 0 = unbounded."""
        reply = await self._acquire(
            keys=[
                scope_config_key(scope_id),
                scope_idle_key(scope_id),
                scope_pods_key(scope_id),
                scope_deploying_key(scope_id),
                idem_key(request_id),
                BUDGET_PODS_KEY,
                BUDGET_RULES_KEY,
                BUDGET_LIMITS_KEY,
                LEASED_SCOPES_KEY,
            ],
            args=[
                POD_PREFIX,
                token,
                placeholder_ttl,
                IDEM_TTL,
                scope_id,
                BUDGET_RULE_PREFIX,
                rule_id,
                rule_pod_budget,
                self.pod_budget,
            ],
        )
        action = reply[0]
        if action == "reused":
            raise _reused(request_id)
        if action == "cached":
            cached = json.loads(reply[1])
            return AcquireOutcome(
                "cached", cached["pod_id"], cached["pod_sse_url"], cached.get("deploy_ver")
            )
        if action == "reuse":
            return AcquireOutcome("reuse", reply[1], reply[2], reply[3])
        if action == "need_deploy":
            return AcquireOutcome("need_deploy", placeholder=reply[1])
        if action == "budget_reached":
            return AcquireOutcome("budget_reached", budget=reply[1])
        return AcquireOutcome(action)

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
        if reply[0] == "ok":
            return PlaceholderOutcome(reply[1])
        return PlaceholderOutcome(None, reply[0], reply[1] if len(reply) > 1 else None)

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

    # --- pod budgets ---------------------------------------------------------------------------

    async def set_rule_pod_budget(self, rule_id: str, limit: int) -> None:
        """A rule's pod budget as config_sync wrote it (0 = unbounded: the limit is dropped)."""
        if limit > 0:
            await self.redis.hset(BUDGET_LIMITS_KEY, rule_id, str(limit))
        else:
            await self.redis.hdel(BUDGET_LIMITS_KEY, rule_id)

    async def budget_used(self, rule_id: str | None = None) -> int:
        """Live units of the global budget (or of a rule's): pods + unexpired placeholders."""
        key = BUDGET_PODS_KEY if rule_id is None else budget_rule_pods_key(rule_id)
        seconds, _ = await self.redis.time()
        return int(await self.redis.zcount(key, seconds, "+inf"))

    async def repair_budgets(self) -> tuple[int, int]:
        """Reconcile's repair of the budgets from the pools (which reconcile keeps equal to
        Kubernetes): missing units added, stale ones dropped, each checked inside a script;
        returns (added, dropped). O(pods + scopes), in slices (FILL_BATCH, PRUNE_BATCH)."""
        added = 0
        scopes = await self.scopes_with_config()
        for i in range(0, len(scopes), FILL_BATCH):
            chunk = scopes[i : i + FILL_BATCH]
            added += int(
                await self._budget_fill(
                    keys=[BUDGET_PODS_KEY, BUDGET_RULES_KEY],
                    args=[SCOPE_PREFIX, BUDGET_RULE_PREFIX, *chunk],
                )
            )
        dropped = await self._prune(BUDGET_PODS_KEY, "")
        rules = [r async for r in self.redis.sscan_iter(BUDGET_RULES_KEY, count=BATCH)]
        for rule_id in rules:
            dropped += await self._prune(budget_rule_pods_key(rule_id), rule_id)
        return added, dropped

    async def _prune(self, key: str, rule_id: str) -> int:
        units = [u async for u, _ in self.redis.zscan_iter(key, count=BATCH)]
        dropped = 0
        for i in range(0, max(len(units), 1), PRUNE_BATCH):  # once even when empty
            dropped += int(
                await self._budget_prune(
                    keys=[key, PODS_ALL_KEY, BUDGET_RULES_KEY],
                    args=[rule_id, SCOPE_PREFIX, POD_PREFIX, *units[i : i + PRUNE_BATCH]],
                )
            )
        return dropped

    # --- deploy leases ---------------------------------------------------------------------------

    async def take_deploy_lease(self, scope_id: str, token: str, lease: float) -> LeaseTake:
        """Lead the scope's deploy for ``lease`` seconds (renewed by ``renew_deploy_lease``),
        inheriting the pod of a leader whose lease lapsed (deploy_lease_take.lua)."""
        reply = await self._lease_take(
            keys=[deploy_lock_key(scope_id), deploy_pod_key(scope_id), PODS_ALL_KEY],
            args=[token, max(int(lease * 1000), 1)],
        )
        if reply[0] == "follower":
            return LeaseTake(False, holder=reply[1])
        if len(reply) > 1:
            cluster = reply[5] if len(reply) > 5 else ""
            orphan = OrphanPod(reply[1], reply[2], float(reply[3]), reply[4], cluster or None)
            return LeaseTake(True, orphan=orphan)
        return LeaseTake(True)

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
        reply = await self._lease_renew(
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
        return str(reply[1]) if reply[0] == "ok" else None

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
        fields = ("pod_id", "namespace", "created", "uid", "failed", "cluster")
        pod_id, namespace, created, uid, failed, cluster = cast(
            list[str | None], await self.redis.hmget(deploy_pod_key(scope_id), *fields)
        )
        if failed or not pod_id:
            return None
        return OrphanPod(pod_id, namespace or "", float(created or 0), uid or "", cluster or None)

    async def deploy_leader(self, scope_id: str) -> str | None:
        """The live deploy leader's token, None without one."""
        return cast(str | None, await self.redis.get(deploy_lock_key(scope_id)))

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
        return DeployView(leader, bool(failed), len(warm) < len(live), bool(warm))

    async def prune_leases(self) -> tuple[int, int]:
        """Drop the follower seats and placeholders whose lease ran out (a replica that died
        left them) in every scope that took one, LEASE_PRUNE_BATCH scopes a script call
        (lease_prune.lua); returns (seats, placeholders) dropped."""
        scopes = [s async for s in self.redis.sscan_iter(LEASED_SCOPES_KEY, count=BATCH)]
        seats = placeholders = 0
        for i in range(0, len(scopes), LEASE_PRUNE_BATCH):
            dropped = await self._lease_prune(
                keys=[LEASED_SCOPES_KEY, BUDGET_PODS_KEY, PODS_ALL_KEY],
                args=[
                    SCOPE_PREFIX,
                    BUDGET_RULE_PREFIX,
                    deploy_lock_key(""),
                    *scopes[i : i + LEASE_PRUNE_BATCH],
                ],
            )
            seats, placeholders = seats + int(dropped[0]), placeholders + int(dropped[1])
        return seats, placeholders

    async def register(
        self,
        *,
        scope_id: str,
        pod_id: str,
        placeholder: str | None,
        pod_sse_url: str,
        pod_ip: str,
        namespace: str,
        deploy_ver: str,
        warm: bool,
        cluster: str | None = None,
    ) -> bool:
        """Returns whether the placeholder was still held (False: it expired meanwhile).
        ``cluster``: where the pod runs (None: the process default; no field is written)."""
        held = await self._register(
            keys=_registration_keys(scope_id, pod_id),
            args=[
                pod_id,
                placeholder or "",
                scope_id,
                pod_sse_url,
                pod_ip,
                namespace,
                deploy_ver,
                "1" if warm else "0",
                BUDGET_RULE_PREFIX,
                cluster or "",
            ],
        )
        return bool(held)

    async def adopt(
        self,
        *,
        scope_id: str,
        pod_id: str,
        pod_sse_url: str,
        pod_ip: str,
        namespace: str,
        deploy_ver: str,
        cluster: str | None = None,
    ) -> AdoptOutcome:
        """A verified pod of ours that Redis does not know into its scope's warm pool
        (adopt.lua: within max_pods and the budgets when the scope has a config, as it is
        when it has none); ``cluster``: where it runs (None: the process default)."""
        reply = await self._adopt(
            keys=[*_registration_keys(scope_id, pod_id), BUDGET_LIMITS_KEY],
            args=[
                pod_id, scope_id, pod_sse_url, pod_ip, namespace, deploy_ver,
                BUDGET_RULE_PREFIX, self.pod_budget, cluster or "",
            ],
        )  # fmt: skip
        return AdoptOutcome(reply[0], reply[1] if len(reply) > 1 else None)

    async def release(self, scope_id: str, pod_id: str) -> bool:
        became_idle = await self._release(
            keys=[
                scope_pods_key(scope_id),
                scope_idle_key(scope_id),
                pod_idle_since_key(pod_id),
                pod_info_key(pod_id),
            ],
            args=[pod_id],
        )
        return bool(became_idle)

    async def purge(self, pod_id: str) -> str | None:
        scope = await self._purge(
            keys=[
                pod_info_key(pod_id),
                pod_idle_since_key(pod_id),
                pod_health_fails_key(pod_id),
                PODS_ALL_KEY,
                BUDGET_PODS_KEY,
            ],
            args=[pod_id, SCOPE_PREFIX, BUDGET_RULE_PREFIX],
        )
        return cast(str | None, scope or None)

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

    # --- reads and single-command changes ------------------------------------------------------

    async def take_out_of_idle(self, scope_id: str, pod_id: str) -> bool:
        """Atomically leave the warm pool, only if still in it (reclaim, before deleting)."""
        removed = await self.redis.srem(scope_idle_key(scope_id), pod_id)
        if removed:
            await self.redis.delete(pod_idle_since_key(pod_id))
        return bool(removed)

    async def pod_info(self, pod_id: str) -> dict[str, str]:
        """The pod's info hash; its ``cluster`` field is absent for the process default (as in
        every info written before pods recorded their cluster): read it with ``info_cluster``."""
        return cast(dict[str, str], await self.redis.hgetall(pod_info_key(pod_id)))

    async def pod_places(self, pod_ids: list[str]) -> dict[str, tuple[str | None, str | None]]:
        """Each pod's (cluster, namespace) from its info: cluster None for the process default
        (the field absent or empty), namespace None when the info has none. In slices."""
        fields = await self.pod_fields(pod_ids, "cluster", "namespace")
        return {p: (cluster or None, namespace) for p, (cluster, namespace) in fields.items()}

    async def _read_many(self, keys: list[str], command: str) -> list[Any]:
        """One reply per key (``read_many`` script: HGETALL or SMEMBERS), SCRIPT_BATCH keys a
        call: one round trip and one reply parsed in C instead of a pipelined command each."""
        replies: list[Any] = []
        for i in range(0, len(keys), SCRIPT_BATCH):
            replies += await self._read_many_script(keys=keys[i : i + SCRIPT_BATCH], args=[command])
        return replies

    async def pod_fields(self, pod_ids: list[str], *fields: str) -> dict[str, list[str | None]]:
        """Some fields of many pods' infos: the jobs' cheap read, one ``pod_fields`` script
        per SCRIPT_BATCH pods (each reply a flat list, n values per pod)."""
        n = len(fields)
        out: dict[str, list[str | None]] = {}
        for i in range(0, len(pod_ids), SCRIPT_BATCH):
            chunk = pod_ids[i : i + SCRIPT_BATCH]
            flat = await self._pod_fields(keys=[], args=[POD_PREFIX, n, *fields, *chunk])
            out.update((p, flat[j * n : j * n + n]) for j, p in enumerate(chunk))
        return out

    async def pod_versions(self, pod_ids: list[str]) -> dict[str, str | None]:
        return {p: v[0] for p, v in (await self.pod_fields(pod_ids, "deploy_ver")).items()}

    async def scope_pods(self, scope_id: str) -> list[str]:
        return cast(list[str], await self.redis.zrange(scope_pods_key(scope_id), 0, -1))

    async def pods_registered_since(self, scope_id: str, since: float) -> list[str]:
        """Pods of the scope registered at or after ``since`` (Redis seconds), newest first."""
        return cast(
            list[str],
            await self.redis.zrevrangebyscore(scope_pods_key(scope_id), "+inf", since),
        )

    async def idle_pods(self, scope_id: str) -> dict[str, float]:
        """Warm pods → idle_since (Redis seconds)."""
        return (await self.idle_pods_of([scope_id]))[scope_id]

    async def idle_pods_of(self, scope_ids: list[str]) -> dict[str, dict[str, float]]:
        """``idle_pods`` of many scopes: pipelined SMEMBERS, then MGETs of the warm ones."""
        members = await self._members_of(scope_ids, scope_idle_key)
        since = await self.idle_since([p for scope_pods in members.values() for p in scope_pods])
        return {s: {p: since.get(p, 0.0) for p in scope_pods} for s, scope_pods in members.items()}

    async def deploying(self, scope_id: str) -> list[str]:
        return cast(list[str], list(await self.redis.smembers(scope_deploying_key(scope_id))))

    async def deploying_of(self, scope_ids: list[str]) -> dict[str, list[str]]:
        """``deploying`` of many scopes, pipelined."""
        return await self._members_of(scope_ids, scope_deploying_key)

    async def live_deploying_of(self, scope_ids: list[str]) -> dict[str, list[str]]:
        """``deploying_of`` without the placeholders past their deadline (Redis clock): those
        of a deployer that died, which nothing waits for any more."""
        members = await self.deploying_of(scope_ids)
        seconds, _ = await self.redis.time()
        return {
            s: [m for m in ms if placeholder_deadline(m) >= int(seconds)]
            for s, ms in members.items()
        }

    async def _members_of(
        self, scope_ids: list[str], key: Callable[[str], str]
    ) -> dict[str, list[str]]:
        sets = await self._read_many([key(s) for s in scope_ids], "SMEMBERS")
        return {s: sorted(members) for s, members in zip(scope_ids, sets, strict=True)}

    async def pod_phases(self) -> dict[str, int]:
        """Registered pods by phase (in_use / idle): O(pods), in slices (``pod_fields``)."""
        counts: dict[str, int] = {"in_use": 0, "idle": 0}
        for (phase,) in (await self.pod_fields(await self.all_pods(), "phase")).values():
            if phase:
                counts[phase] = counts.get(phase, 0) + 1
        return counts

    async def placeholders(self, scope_ids: list[str]) -> int:
        """Deploys in flight (placeholders) over the given scopes: one SCARD each, pipelined."""
        if not scope_ids:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in scope_ids:
                pipe.scard(scope_deploying_key(scope_id))
            return sum(int(n) for n in await pipe.execute())

    async def scope_pool(self, scope_id: str) -> dict[str, Any]:
        """Admin view of a scope's pool: parameters, pods with their phase, warm pods,
        live placeholders (deploys in flight), the follower room and the deploy lock (its
        token names the replica that leads the deploy)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(scope_config_key(scope_id))
            pipe.zrange(scope_pods_key(scope_id), 0, -1)
            pipe.smembers(scope_idle_key(scope_id))
            pipe.smembers(scope_deploying_key(scope_id))
            pipe.zcard(scope_followers_key(scope_id))
            pipe.get(deploy_lock_key(scope_id))
            pipe.time()
            config, pods, idle, deploying, followers, leader, (now, _) = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pods:
                pipe.hmget(pod_info_key(pod_id), "phase", "deploy_ver", "pod_ip")
            infos = await pipe.execute()
        return {
            "pool_config": config or None,
            "pods": [
                {"pod_id": p, "phase": i[0], "deploy_ver": i[1], "pod_ip": i[2]}
                for p, i in zip(pods, infos, strict=True)
            ],
            "idle": sorted(idle),
            "deploys_in_flight": sum(placeholder_deadline(m) >= int(now) for m in deploying),
            "followers": int(followers),
            "deploy_lock_held": leader is not None,
            "deploy_leader": leader,
        }

    async def all_pods(self) -> list[str]:
        return [p async for p in self.redis.sscan_iter(PODS_ALL_KEY, count=BATCH)]

    async def cached_result(self, scope_id: str, request_id: str) -> dict[str, str] | None:
        """The pod this request_id got for this scope within IDEM_TTL; RequestIdReused when
        it got one for another scope (never handed to this one)."""
        raw = await self.redis.get(idem_key(request_id))
        if not raw:
            return None
        cached = cast(dict[str, str], json.loads(raw))
        owner = cached.pop("scope_id", None)
        if owner is not None and owner != scope_id:
            raise _reused(request_id)
        return cached

    async def cache_result(self, scope_id: str, request_id: str, result: dict[str, str]) -> None:
        value = json.dumps({**result, "scope_id": scope_id})
        await self.redis.set(idem_key(request_id), value, ex=IDEM_TTL)

    async def idle_since(self, pod_ids: list[str]) -> dict[str, float]:
        """When each warm pod joined the warm pool (Redis seconds); a pod that is not warm is
        left out. MGETs of BATCH keys."""
        since: dict[str, float] = {}
        for i in range(0, len(pod_ids), BATCH):
            chunk = pod_ids[i : i + BATCH]
            values = await self.redis.mget([pod_idle_since_key(p) for p in chunk])
            since.update((p, float(v)) for p, v in zip(chunk, values, strict=True) if v)
        return since

    # --- foreign pods (reconcile's report) -----------------------------------------------------

    async def report_foreign(self, count: int, pods: dict[str, dict[str, Any]]) -> None:
        """Replace the report: ``count`` foreign pods seen, ``pods`` (a bounded number of them)
        by "{namespace}/{pod}"."""
        flat = [x for field, pod in pods.items() for x in (field, json.dumps(pod, sort_keys=True))]
        await self._foreign_report(keys=[FOREIGN_PODS_KEY, FOREIGN_COUNT_KEY], args=[count, *flat])

    async def foreign_pods(self) -> tuple[int, list[dict[str, Any]]]:
        """The last report: how many were seen, and those it holds (sorted by namespace/pod)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(FOREIGN_COUNT_KEY)
            pipe.hgetall(FOREIGN_PODS_KEY)
            count, pods = await pipe.execute()
        return int(count or 0), [json.loads(pods[k]) for k in sorted(pods)]

    async def foreign_pod_count(self) -> int:
        return int(await self.redis.get(FOREIGN_COUNT_KEY) or 0)

    async def count_health_failure(self, pod_id: str) -> int:
        """One more failed probe; 0 if the pod has been forgotten meanwhile.

        A probe can race the pod's purge (reclaim, watch or reconcile of another tick or
        replica): checked AFTER the increment, so either the purge comes later and deletes the
        counter itself, or we see it gone and delete the counter we just made.
        """
        key = pod_health_fails_key(pod_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, 3600)
            fails, _ = await pipe.execute()
        if not await self.redis.sismember(PODS_ALL_KEY, pod_id):
            await self.redis.delete(key)
            return 0
        return int(fails)

    async def clear_health_failures(self, *pod_ids: str) -> None:
        if pod_ids:
            await self.redis.delete(*(pod_health_fails_key(p) for p in pod_ids))

    async def now(self) -> float:
        """Redis server time: the one clock all replicas share."""
        seconds, micros = await self.redis.time()
        return seconds + micros / 1_000_000
