"""Resource manager state in Redis: the only module that names the ``resource_manager:`` keys.

Key table: contract §4 and ``docs/design/hld.md`` §5. Every key name and key builder is here,
and the hashes' layouts (a pool config, a pod's info, an acquire result); the other state
modules build their keys with these builders: ``deploy_state.py`` (placeholders, deploy leases,
follower seats), ``pool_jobs_state.py`` (the jobs' reads in slices and their own changes) and
``views.py`` (admin views and gauges, read only). Nothing else of the resource manager talks
to Redis. Every change of a pool is one Lua script from ``lua/`` (registered once, called by
EVALSHA), whose reply is decoded once, by the state module that calls it, into a typed value
of ``state_values.py``; plain commands are used only for reads, for single-command changes
(SREM out of the idle pool, the per-pod fail counter) and for the pool config (one HSET).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, cast

from redis.asyncio import Redis
from redis.cluster import key_slot

from agent_runtime import lua
from agent_runtime.config import RM_KEY_PREFIX as P
from agent_runtime.redis_client import is_cluster
from agent_runtime.resource_manager.budget_state import (
    DEFAULT_POD_BUDGET,
    BudgetState,
    reservation_unit,
    token_of,
)
from agent_runtime.resource_manager.models import AcquiredPod
from agent_runtime.resource_manager.state_values import (
    AcquireOutcome,
    PlaceholderOutcome,
    PodInfo,
    PoolConfig,
)
from agent_runtime.scope_buckets import DueIndex, bucket_of, bucket_tag

# Every key of one scope's state carries the scope id as its Redis Cluster hash tag, braces
# included ("resource:scope:{<sid>}:pods", "lock:rm:deploy:{<sid>}:<deploy id>"): a script
# that touches one scope touches one slot. A script given SCOPE_PREFIX derives the same names
# with lua/_keys.lua.
SCOPE_PREFIX = f"{P}resource:scope:"
# A pod's keys carry its scope's tag too ("resource:pod:{<sid>}:<pod id>:info"): a pod belongs
# to one scope, and its keys go with the scope's into the scope's scripts. Lua derives them
# with pod_key (lua/_keys.lua).
POD_PREFIX = f"{P}resource:pod:"
# The pod index: which scope a pod id belongs to, for the doors that know only the pod (a
# gateway's report, the admin pod view, a drain by pod, watch events). A HASH pod id -> scope
# id per bucket of pod ids ("resource:pods:{b07}", bucket_of(pod id)): one HGET. Written by
# Python beside the scripts (a script of one scope cannot reach it): before registration (a
# crash never leaves a registered pod unindexed), deleted after the purge; reconcile repairs
# what a crash left between the two steps (index_pods).
PODS_INDEX_PREFIX = f"{P}resource:pods:"
# Not in the contract (nothing outside reads it): every scope with a pool config, so the jobs
# find them with an SSCAN of their own set instead of a SCAN of the whole keyspace (at 100k
# sessions ~150k keys, 300 round trips a tick). Written with the config; reconcile adds any
# config the index lacks (an upgrade from a version without it, a config written by hand).
# One SET per bucket of scope ids ("resource:scopes:{b07}", bucket_of(scope id)), walked
# bucket by bucket: a script of one scope cannot reach it, so pool_config.lua replies
# "written" and Python adds the scope; scope_expire.lua replies "gone" and Python removes it
# (then looks again: a config written meanwhile puts it back).
SCOPES_PREFIX = f"{P}resource:scopes:"
SCOPE_CONFIG_PATTERN = f"{SCOPE_PREFIX}{{*}}:config"
# Not in the contract: scopes that took a follower seat or a placeholder, where a dead
# replica's leftovers can be (lease_prune.lua): a DueIndex per bucket (scope -> when to look),
# marked by Python after the script that took the lease, settled by the prune job; a mark
# lost with a crash is found by the job's slow walk over every scope.
LEASED_PREFIX = f"{P}resource:leased_scopes:"
# Reconcile's report of pods with our labels that are not provably ours (foreign_report.lua):
# both keys under one hash tag of their own, "{foreign}" (literal), as the script writes both
FOREIGN_TAG = "{foreign}"
FOREIGN_PODS_KEY = f"{P}resource:foreign_pods:{FOREIGN_TAG}"
FOREIGN_COUNT_KEY = f"{P}resource:foreign_pods:{FOREIGN_TAG}:count"
# Drains (drains.py): the pods being drained, pod -> deadline (Redis seconds), one ZSET per
# bucket of the pods' scopes ("resource:draining:{b07}"), beside each pod's
# ``pod:{sid}:{pod}:drain`` hash: drain_begin.lua writes the hash and replies the deadline,
# Python then adds the pod here; purge.lua drops the hash, Python then the entry. The drains
# job drops an entry without a hash; reconcile adds one a crash left out.
DRAINING_PREFIX = f"{P}resource:draining:"
DEPLOY_LOCK_PREFIX = f"{P}lock:rm:deploy:"  # + "{<sid>}:<deploy id>"
IDEM_TTL = 60
DEPLOY_TIMES_KEPT = 32  # a scope's recent deploy times (deploy_time.lua)
DEPLOY_TIMES_TTL = 86400  # seconds the list outlives the scope's last deploy
PACKAGE = "agent_runtime.resource_manager"  # where the lua/ folder is
KEYS_PRELUDE = "_keys"  # the prelude that derives key names in Lua, before any other


def scope_key_head(scope_id: str) -> str:
    """The head of a scope's keys, ``resource_manager:resource:scope:{<sid>}:`` (what
    deploy_claim.lua is given to derive a deploy's room and record)."""
    return f"{SCOPE_PREFIX}{{{scope_id}}}:"


def scope_of_config_key(key: str) -> str | None:
    """The scope id of a ``resource:scope:{<sid>}:config`` key found by a SCAN (None: not
    one of this layout's)."""
    head, _, rest = key.partition("{")
    sid, closed, tail = rest.partition("}")
    return sid if head == SCOPE_PREFIX and closed and tail == ":config" else None


def scope_config_key(scope_id: str) -> str:
    return f"{scope_key_head(scope_id)}config"


def scope_pods_key(scope_id: str) -> str:
    return f"{scope_key_head(scope_id)}pods"


def scope_idle_key(scope_id: str) -> str:
    return f"{scope_key_head(scope_id)}idle"


def scope_deploying_key(scope_id: str) -> str:
    return f"{scope_key_head(scope_id)}deploying"


def scope_followers_key(scope_id: str, deploy_id: str) -> str:
    """The follower room of one cold deploy: request id -> seat deadline (≤ pod_concurrency - 1
    seats; the key lives at most ``record_ttl`` after its last seat was taken)."""
    return f"{scope_key_head(scope_id)}deploy_followers:{deploy_id}"


def scope_cold_deploys_key(scope_id: str) -> str:
    """The scope's cold deploys (routes'): deploy id -> when it was first led (Redis seconds).
    A member is live while its lock exists; one whose lock lapsed stays while its record
    names a pod nobody registered (to be taken over), and leaves at the next claim or prune."""
    return f"{scope_key_head(scope_id)}cold_deploys"


def scope_deploy_times_key(scope_id: str) -> str:
    """The scope's recent deploy times, seconds, newest first (deploy_time.lua; at most
    DEPLOY_TIMES_KEPT): a predictive warm pool plans with a high percentile of them."""
    return f"{scope_key_head(scope_id)}deploy_times"


def scope_config_gen_key(scope_id: str) -> str:
    """The config_sync generation that last wrote the scope's pool config (not in the
    contract: the config hash keeps exactly the contract's fields)."""
    return f"{scope_key_head(scope_id)}config_gen"


def pod_key_head(scope_id: str, pod_id: str) -> str:
    """The head of a pod's keys, ``resource_manager:resource:pod:{<sid>}:<pod id>:``."""
    return f"{POD_PREFIX}{{{scope_id}}}:{pod_id}:"


def pod_info_key(scope_id: str, pod_id: str) -> str:
    return f"{pod_key_head(scope_id, pod_id)}info"


def pod_idle_since_key(scope_id: str, pod_id: str) -> str:
    return f"{pod_key_head(scope_id, pod_id)}idle_since"


def pod_health_fails_key(scope_id: str, pod_id: str) -> str:
    return f"{pod_key_head(scope_id, pod_id)}health_fails"


def pod_drain_key(scope_id: str, pod_id: str) -> str:
    """The pod's drain: deadline, trigger, since, state (pending | draining), scope_id."""
    return f"{pod_key_head(scope_id, pod_id)}drain"


def pod_reported_key(scope_id: str, pod_id: str) -> str:
    """A gateway's report of the pod: the window of its one probe (pod_report.lua)."""
    return f"{pod_key_head(scope_id, pod_id)}reported"


def scopes_key(bucket: str) -> str:
    """One bucket of the scope index (``bucket``: its tag, ``{b07}``): scopes with a config."""
    return f"{SCOPES_PREFIX}{bucket}"


def scope_index_key(scope_id: str) -> str:
    """The bucket of the scope index that holds ``scope_id``."""
    return scopes_key(bucket_tag(bucket_of(scope_id)))


def leased_scopes_key(bucket: str) -> str:
    """One bucket of the leased scopes' DueIndex: scope id -> when the prune looks at it."""
    return f"{LEASED_PREFIX}{bucket}"


def draining_key(bucket: str) -> str:
    """One bucket of the draining pods (by their scope's bucket): pod id -> drain deadline."""
    return f"{DRAINING_PREFIX}{bucket}"


def scope_draining_key(scope_id: str) -> str:
    """The bucket of the draining pods that holds the pods of ``scope_id``."""
    return draining_key(bucket_tag(bucket_of(scope_id)))


def pods_index_key(bucket: str) -> str:
    """One bucket of the pod index (``bucket``: its tag, ``{b07}``): pod id -> scope id."""
    return f"{PODS_INDEX_PREFIX}{bucket}"


def pod_index_key(pod_id: str) -> str:
    """The bucket of the pod index that holds ``pod_id``."""
    return pods_index_key(bucket_tag(bucket_of(pod_id)))


def deploy_lock_key(scope_id: str, deploy_id: str) -> str:
    """One cold deploy's leader: its token on a lease (a scope runs many deploys at once)."""
    return f"{deploy_lock_prefix(scope_id)}{deploy_id}"


def deploy_lock_prefix(scope_id: str) -> str:
    """What a script prepends to a deploy id to get its lock (deploy_claim.lua)."""
    return f"{DEPLOY_LOCK_PREFIX}{{{scope_id}}}:"


def deploy_pod_key(scope_id: str, deploy_id: str) -> str:
    """One cold deploy's pod, recorded once created (its name, namespace, uid and cluster,
    under the leader's token), or the notice of a failed deploy (not in the contract)."""
    return f"{scope_key_head(scope_id)}deploy_pod:{deploy_id}"


# the deploy record's fields (deploy_lease*.lua write them), as deploy_state reads them back
DEPLOY_RECORD_FIELDS = ("pod_id", "namespace", "created", "uid", "failed", "cluster")
# the pod info fields the admin scope view shows per pod
POD_VIEW_FIELDS = ("phase", "deploy_ver", "pod_ip")


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
    return f"{scope_key_head(scope_id)}registered"


REGISTERED_PATTERN = f"{SCOPE_PREFIX}{{*}}:registered"


def idem_key(scope_id: str, request_id: str) -> str:
    """The acquire result for 60 s, kept per scope (another scope's acquire with the id is
    another request's and never reads it; ``scope_id`` is in the JSON too)."""
    return f"{P}idem:{{{scope_id}}}:{request_id}"


# --- typed values and the decoding of hashes and replies ---------------------------------------


def hash_of(flat: list[str]) -> dict[str, str]:
    """A hash as a script returns it (field, value, field, value ...) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def pool_config_of(raw: dict[str, str]) -> PoolConfig | None:
    """A scope's config hash (None: it has none)."""
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
        warm_pool=raw.get("warm_pool") or "static",
    )


@functools.lru_cache(maxsize=4096)
def _parsed_spec(raw: str) -> dict[str, Any]:
    """A pod spec's JSON, parsed once per distinct text: the jobs read every scope's config
    every second and scopes of one template share it (1k parses were the longest loop slice
    of a tick). The dict is shared: read it, never change it."""
    return cast(dict[str, Any], json.loads(raw))


def _pod_info_of(raw: dict[str, str]) -> PodInfo | None:
    if not raw:
        return None
    return PodInfo(
        scope_id=raw.get("scope_id", ""),
        pod_sse_url=raw.get("pod_sse_url", ""),
        pod_ip=raw.get("pod_ip", ""),
        namespace=raw.get("namespace") or None,
        phase=raw.get("phase", ""),
        deploy_ver=raw.get("deploy_ver", ""),
        cluster=raw.get("cluster") or None,
    )


def _idem_of(raw: str) -> AcquiredPod:
    """An ``idem:{sid}:{rid}`` value's pod."""
    cached = cast(dict[str, str], json.loads(raw))
    return AcquiredPod(cached["pod_id"], cached["pod_sse_url"], cached.get("deploy_ver") or "")


def _acquire_outcome(reply: list[str]) -> AcquireOutcome:
    action = reply[0]
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
    return AcquireOutcome(cast(Any, action))


def registration_keys(scope_id: str, pod_id: str) -> list[str]:
    """What registering a pod writes: KEYS[1..6] of register.lua and adopt.lua alike (the pod
    index and its budget unit are written before, by ``ResourceState.register``)."""
    return [
        pod_info_key(scope_id, pod_id),
        scope_pods_key(scope_id),
        scope_deploying_key(scope_id),
        scope_idle_key(scope_id),
        pod_idle_since_key(scope_id, pod_id),
        scope_config_key(scope_id),
    ]


class ResourceState:
    """The pools in Redis as a route's acquire and a deploy use them: pool configs, acquire
    and its replay, a pod's registration and release, one pod's reads, the clock (client with
    decode_responses). The sibling state modules are built over it (``DeployState(state)``,
    ``PoolScan(state)``, ``ResourceViews(state)``): one client, one script observer, one pod
    budget; ``script`` registers their scripts."""

    def __init__(
        self,
        redis: Redis,
        *,
        observe: lua.ScriptObserver | None = None,
        pod_budget: int = DEFAULT_POD_BUDGET,
        wait: lua.ReplicaWait | None = None,
    ) -> None:
        self.redis = redis
        self.wait = wait  # WAIT after a pod's registration (AGENT_RUNTIME_REDIS_WAIT_*)
        self._observe = observe
        # the pod budgets: a step of their own around the scope's scripts (another slot)
        self.budget = BudgetState(redis, self.script, pod_budget)
        self._acquire = self.script("acquire", "_placeholders")
        self._register = self.script("register")
        self._placeholder = self.script("placeholder", "_placeholders")
        self._drop_placeholder = self.script("drop_placeholder")
        self._release = self.script("release")
        self._pool_config_script = self.script("pool_config")
        self._scope_expire = self.script("scope_expire")
        self._deploy_time = self.script("deploy_time")
        # scopes that took a lease (placeholder, follower seat, cold deploy): the prune's
        self.leased = DueIndex(
            redis, lambda b: leased_scopes_key(bucket_tag(b)), name="rm_leased", observe=observe
        )

    @property
    def pod_budget(self) -> int:
        """The installation's pod budget: pods + live reservations of all scopes."""
        return self.budget.pod_budget

    @pod_budget.setter
    def pod_budget(self, value: int) -> None:
        self.budget.pod_budget = value

    def key_slices(self, keys: list[str], size: int) -> list[list[int]]:
        """The positions of ``keys`` cut into script calls of at most ``size`` keys; on a
        Redis Cluster each call's keys are of one slot (one scope's), as a script needs there
        (a read over many scopes then costs a call per scope)."""
        if not is_cluster(self.redis):
            return [list(range(i, min(i + size, len(keys)))) for i in range(0, len(keys), size)]
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(key_slot(key.encode()), []).append(i)
        return [
            positions[j : j + size]
            for positions in by_slot.values()
            for j in range(0, len(positions), size)
        ]

    def script(self, name: str, *preludes: str) -> Any:
        """A script of the resource manager's ``lua/`` folder on this client (EVALSHA), after
        the key builders (lua/_keys.lua) and ``preludes``."""
        return lua.register(
            self.redis, PACKAGE, name, prelude=(KEYS_PRELUDE, *preludes), observe=self._observe
        )

    def shared_script(self, name: str, *, label: str) -> Any:
        """A script of the shared ground (``agent_runtime/lua_shared/``) on this client, timed
        under ``label`` (what it does here)."""
        return lua.register(self.redis, lua.SHARED, name, label=label, observe=self._observe)

    # --- pool config ---------------------------------------------------------------------------

    async def write_pool_config(
        self,
        scope_id: str,
        pool_config: Mapping[str, int | str],
        *,
        deploy_ver: str | None = None,
        pod_spec: dict[str, Any] | None = None,
        generation: int | None = None,
    ) -> bool:
        """One HSET: pool parameters, and with a pod spec also its version (atomic together);
        the scope joins the index in the same script (pool_config.lua). With a
        ``generation`` (config_sync's), refused (False) when a newer config_sync already
        wrote the config: overlapping propagations converge to the later one."""
        fields = {k: v if isinstance(v, str) else str(int(v)) for k, v in pool_config.items()}
        if pod_spec is not None:
            assert deploy_ver is not None
            fields["deploy_ver"] = deploy_ver
            fields["pod_spec_json"] = json.dumps(pod_spec, sort_keys=True, separators=(",", ":"))
        flat = [x for kv in fields.items() for x in kv]
        written = await self._pool_config_script(
            keys=[scope_config_key(scope_id), scope_config_gen_key(scope_id)],
            args=["" if generation is None else generation, *flat],
        )
        if written:  # into the scope index after (a crash between: reconcile's index_scopes)
            await self.redis.sadd(scope_index_key(scope_id), scope_id)
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
                scope_cold_deploys_key(scope_id),
                scope_config_gen_key(scope_id),
            ],
        )
        if gone:  # out of the scope index; back in if a config was written meanwhile
            await self.budget.forget(scope_id)
            await self.redis.srem(scope_index_key(scope_id), scope_id)
            if await self.redis.exists(scope_config_key(scope_id)):
                await self.redis.sadd(scope_index_key(scope_id), scope_id)
        return bool(gone)

    async def pool_config(self, scope_id: str) -> PoolConfig | None:
        return pool_config_of(
            cast(dict[str, str], await self.redis.hgetall(scope_config_key(scope_id)))
        )

    async def set_rule_pod_budget(self, rule_id: str, limit: int) -> None:
        """A rule's pod budget as config_sync wrote it (0 = unbounded: the limit is dropped)."""
        await self.budget.set_rule_limit(rule_id, limit)

    # --- acquire -------------------------------------------------------------------------------

    async def acquire(
        self,
        scope_id: str,
        request_id: str,
        token: str,
        placeholder_ttl: int,
        *,
        rule_id: str = "",
        rule_pod_budget: int = 0,
        cold_claim: bool = False,
    ) -> AcquireOutcome:
        """``rule_id``: the rule the scope resolves through now (its units follow it there);
        ``rule_pod_budget``: that rule's budget, 0 = unbounded. A warm pod, or "cold": with
        ``cold_claim`` nothing is reserved (the claim reserves the slot if it leads), without
        it a placeholder is taken (``reserve_placeholder``: "need_deploy", or the refusal)."""
        reply = await self._acquire(
            keys=[
                scope_config_key(scope_id),
                scope_idle_key(scope_id),
                scope_pods_key(scope_id),
                scope_deploying_key(scope_id),
                idem_key(scope_id, request_id),
            ],
            args=[POD_PREFIX, token, IDEM_TTL, scope_id, rule_id],
        )
        if reply[-1] == "relink":  # the scope's rule changed: its units follow (rare)
            await self.budget.link(scope_id, rule_id, rule_pod_budget)
            reply = reply[:-1]
        outcome = _acquire_outcome(reply)
        if outcome.action != "cold" or cold_claim:
            return outcome
        placed = await self.reserve_placeholder(
            scope_id, token, placeholder_ttl, rule=(rule_id, rule_pod_budget)
        )
        if placed.member is not None:
            return AcquireOutcome("need_deploy", placeholder=placed.member)
        return AcquireOutcome(cast(Any, placed.refused), budget=placed.budget)

    # --- placeholders: a deploy slot within max_pods, with its budget unit ---------------------

    async def reserve_placeholder(
        self,
        scope_id: str,
        token: str,
        placeholder_ttl: int,
        *,
        rule: tuple[str, int] | None = None,
    ) -> PlaceholderOutcome:
        """A placeholder for a deploy of ``token`` (placeholder.lua) with its budget unit:
        asked first whether a slot is free, then the unit reserved (budget_reserve.lua), then
        the placeholder taken; the unit given back if it is not. ``rule``: see
        ``BudgetState.reserve``. The scope is marked leased when a member is returned."""
        outcome = await self._take_placeholder(scope_id, token, placeholder_ttl, reserved=False)
        if outcome.refused != "reserve":
            return outcome
        unit = reservation_unit(scope_id, token)
        refused = await self.budget.reserve(scope_id, unit, placeholder_ttl, rule=rule)
        if refused is not None:
            return PlaceholderOutcome(None, "budget_reached", refused)
        try:
            outcome = await self._take_placeholder(scope_id, token, placeholder_ttl, reserved=True)
        finally:
            if outcome.member is None or outcome.refused == "reserve":
                await self.budget.release(scope_id, unit)
        return outcome

    async def _take_placeholder(
        self, scope_id: str, token: str, placeholder_ttl: int, *, reserved: bool
    ) -> PlaceholderOutcome:
        reply = await self._placeholder(
            keys=[
                scope_config_key(scope_id),
                scope_pods_key(scope_id),
                scope_deploying_key(scope_id),
            ],
            args=[token, placeholder_ttl, "1" if reserved else "0"],
        )
        if reply[0] != "ok":
            return PlaceholderOutcome(None, str(reply[0]))
        await self.mark_leased(scope_id)
        return PlaceholderOutcome(str(reply[1]))

    async def drop_placeholders(self, scope_id: str, mode: str, value: str) -> int:
        """Give back placeholders (``mode`` "member": the member ``value``; "token": every
        member taken with the token ``value``), then their budget unit."""
        dropped = await self._drop_placeholder(
            keys=[scope_deploying_key(scope_id)], args=[mode, value]
        )
        token = token_of(value) if mode == "member" else value
        await self.budget.release(scope_id, reservation_unit(scope_id, token))
        return int(dropped)

    async def mark_leased(self, scope_id: str) -> None:
        """The scope holds a lease now (placeholder, seat, cold deploy): the prune job looks
        at it at its next pass (lease_prune says when to look again)."""
        await self.leased.mark(scope_id, 0.0)

    async def cached_result(self, scope_id: str, request_id: str) -> AcquiredPod | None:
        """The pod this request_id got for this scope within IDEM_TTL (another scope's result
        with the id is under that scope's key: never read here)."""
        raw = cast(str | None, await self.redis.get(idem_key(scope_id, request_id)))
        return _idem_of(raw) if raw else None

    async def cache_result(self, scope_id: str, request_id: str, pod: AcquiredPod) -> None:
        value = json.dumps(
            {"pod_id": pod.pod_id, "pod_sse_url": pod.pod_sse_url,
             "deploy_ver": pod.deploy_ver, "scope_id": scope_id}
        )  # fmt: skip
        await self.redis.set(idem_key(scope_id, request_id), value, ex=IDEM_TTL)

    # --- a pod's registration and release ------------------------------------------------------

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
        ``cluster``: where the pod runs (None: the process default; no field is written).
        The pod index first, then the pod's budget unit in place of its placeholder's
        reservation: a crash between the steps leaves an indexed pod that is not registered
        and maybe its unit (reconcile drops both), never a registered pod nobody can find or
        the budgets do not count."""
        await self.index_pod(scope_id, pod_id)
        reservation = reservation_unit(scope_id, token_of(placeholder)) if placeholder else None
        await self.budget.confirm(scope_id, pod_id, reservation)
        held = await lua.run_acked(
            self.redis,
            self._register,
            wait=self.wait,
            use="register",
            keys=registration_keys(scope_id, pod_id),
            args=[
                pod_id, placeholder or "", scope_id, pod_sse_url, pod_ip, namespace, deploy_ver,
                "1" if warm else "0", cluster or "",
            ],
        )  # fmt: skip
        return bool(held)

    async def release(self, scope_id: str, pod_id: str) -> bool:
        became_idle = await self._release(
            keys=[
                scope_pods_key(scope_id),
                scope_idle_key(scope_id),
                pod_idle_since_key(scope_id, pod_id),
                pod_info_key(scope_id, pod_id),
            ],
            args=[pod_id],
        )
        return bool(became_idle)

    # --- one pod's reads -----------------------------------------------------------------------

    async def pod_info(self, pod_id: str, scope_id: str | None = None) -> PodInfo | None:
        """The pod's info (None: not registered); without ``scope_id`` the pod index names
        the scope (one HGET more)."""
        if scope_id is None and (scope_id := await self.scope_of_pod(pod_id)) is None:
            return None
        raw = await self.redis.hgetall(pod_info_key(scope_id, pod_id))
        return _pod_info_of(cast(dict[str, str], raw))

    # --- the pod index: pod id -> scope id -----------------------------------------------------

    async def scope_of_pod(self, pod_id: str) -> str | None:
        """The scope the pod index names for the pod (None: not indexed: not registered)."""
        return cast(str | None, await self.redis.hget(pod_index_key(pod_id), pod_id))

    async def scopes_of_pods(self, pod_ids: list[str]) -> dict[str, str]:
        """The scope of each indexed pod (one left out: not indexed), one HMGET per bucket
        (a pipeline: at most BUCKETS commands, each one slot)."""
        by_bucket: dict[str, list[str]] = {}
        for pod_id in dict.fromkeys(pod_ids):
            by_bucket.setdefault(pod_index_key(pod_id), []).append(pod_id)
        if not by_bucket:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, pods in by_bucket.items():
                pipe.hmget(key, pods)
            replies = cast(list[list[str | None]], await pipe.execute())
        return {
            pod_id: scope_id
            for pods, scopes in zip(by_bucket.values(), replies, strict=True)
            for pod_id, scope_id in zip(pods, scopes, strict=True)
            if scope_id
        }

    async def index_pod(self, scope_id: str, pod_id: str) -> None:
        """The pod into the index (before its registration: see ``register``)."""
        await self.redis.hset(pod_index_key(pod_id), pod_id, scope_id)

    async def unindex_pod(self, pod_id: str) -> None:
        """The pod out of the index (after its purge)."""
        await self.redis.hdel(pod_index_key(pod_id), pod_id)

    async def record_deploy_time(self, scope_id: str, seconds: float) -> None:
        """One successful deploy's duration into the scope's recent deploy times."""
        await self._deploy_time(
            keys=[scope_deploy_times_key(scope_id)],
            args=[seconds, DEPLOY_TIMES_KEPT, DEPLOY_TIMES_TTL],
        )

    # --- the clock -----------------------------------------------------------------------------

    async def now(self) -> float:
        """Redis server time: the one clock all replicas share."""
        seconds, micros = await self.redis.time()
        return seconds + micros / 1_000_000
