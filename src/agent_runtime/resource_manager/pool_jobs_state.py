"""The pools in Redis as the pool jobs (``pool_jobs.py``) use them: every scope and pod read
in slices, and the jobs' own changes — reclaim's take out of the warm pool, a pod's purge,
watch's health counters, reconcile's adoption, index and budget repairs, and its report of
foreign pods. Keys from ``state.py``'s builders; each reply decoded here, once.

Red line 9: a job reads in slices — a read-only script (``read_many``, ``pod_fields``) or an
MGET per ≤ 200–500 keys, never a pipelined command per key — each holding Redis ≤ ~0.5 ms.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, cast

from agent_runtime.redis_client import is_cluster
from agent_runtime.resource_manager.budget_state import (
    RESERVATION_MARGIN,
    BudgetFix,
    reservation_unit,
    token_of,
)
from agent_runtime.resource_manager.models import WARM_TOKEN_PREFIX
from agent_runtime.resource_manager.state import (
    FOREIGN_COUNT_KEY,
    FOREIGN_PODS_KEY,
    SCOPE_CONFIG_PATTERN,
    ResourceState,
    hash_of,
    placeholder_deadline,
    pod_drain_key,
    pod_health_fails_key,
    pod_idle_since_key,
    pod_info_key,
    pods_index_key,
    pool_config_of,
    registration_keys,
    scope_config_key,
    scope_deploy_times_key,
    scope_deploying_key,
    scope_draining_key,
    scope_idle_key,
    scope_index_key,
    scope_of_config_key,
    scope_pods_key,
    scopes_key,
)
from agent_runtime.resource_manager.state_values import (
    AdoptOutcome,
    BudgetRepair,
    InFlight,
    PodPhase,
    PodPlace,
    PoolConfig,
)
from agent_runtime.scope_buckets import BUCKETS, bucket_tag

# The jobs' reads come in slices, a round trip each, so no slice holds the loop for long
# and no call holds Redis (single-threaded: a route waits behind it) for more than ~0.5 ms.
BATCH = 500  # keys per MGET / SADD, members per SSCAN page (~0.3 ms in Redis)
SCRIPT_BATCH = 200  # keys per pod_fields / read_many call (~2–3 µs each inside Redis)
REPAIR_SLICE = 200  # scopes whose pools and units reconcile's budget repair reads at once
ADOPT_RESERVATION = 30  # seconds an adoption's unit is reserved between its two script calls
INF = float("inf")
HEALTH_FAILS_TTL = 3600  # a fail counter nobody clears (its pod forgotten) goes by itself


class PoolJobsState:
    """What the pool jobs read and change, over a ``ResourceState``'s client."""

    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self.state = state
        self._cluster = is_cluster(state.redis)
        # pods indexed but unregistered at the last index repair: dropped if still so at the
        # next (a registration runs between its index write and its script meanwhile)
        self._unregistered: set[str] = set()
        self._pod_fields = state.script("pod_fields")
        self._read_many_script = state.script("read_many")
        self._foreign_report = state.script("foreign_report")
        self._adopt = state.script("adopt", "_placeholders")
        self._purge = state.script("purge")

    # --- scopes and their pools, in slices -----------------------------------------------------

    async def scopes_with_config(self) -> list[str]:
        """Every scope with a pool config: the scope index, bucket by bucket (SSCAN; every
        bucket's first page in one pipeline, then the buckets that hold more)."""
        keys = [scopes_key(bucket_tag(bucket)) for bucket in range(BUCKETS)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.sscan(key, 0, count=BATCH)
            pages = cast(list[tuple[int, list[str]]], await pipe.execute())
        scopes: list[str] = []
        for key, (cursor, page) in zip(keys, pages, strict=True):
            scopes += page
            while int(cursor):
                cursor, more = await self.redis.sscan(key, cursor, count=BATCH)
                scopes += cast(list[str], more)
        return list(dict.fromkeys(scopes))  # SSCAN may give a member twice

    async def pool_configs(self, scope_ids: list[str]) -> dict[str, PoolConfig]:
        """The pool config of many scopes (those without one left out), in slices."""
        raws = await self._read_many([scope_config_key(s) for s in scope_ids], "HGETALL")
        return {
            scope_id: config
            for scope_id, flat in zip(scope_ids, raws, strict=True)
            if (config := pool_config_of(hash_of(flat))) is not None
        }

    async def idle_pods(self, scope_id: str) -> dict[str, float]:
        """Warm pods → idle_since (Redis seconds)."""
        return (await self.idle_pods_of([scope_id]))[scope_id]

    async def idle_pods_of(self, scope_ids: list[str]) -> dict[str, dict[str, float]]:
        """``idle_pods`` of many scopes: SMEMBERS in slices, then MGETs of the warm ones."""
        members = await self._members_of(scope_ids, scope_idle_key)
        since = await self.idle_since({p: s for s, ps in members.items() for p in ps})
        return {s: {p: since.get(p, 0.0) for p in scope_pods} for s, scope_pods in members.items()}

    async def live_deploying_of(self, scope_ids: list[str]) -> dict[str, list[str]]:
        """Each scope's placeholders without those past their deadline (Redis clock): those
        of a deployer that died, which nothing waits for any more."""
        members = await self._members_of(scope_ids, scope_deploying_key)
        seconds, _ = await self.redis.time()
        return {
            s: [m for m in ms if placeholder_deadline(m) >= int(seconds)]
            for s, ms in members.items()
        }

    async def in_flight_of(self, scope_ids: list[str]) -> dict[str, InFlight]:
        """Each scope's live placeholders: the warm pool's deploys and the routes'."""
        in_flight: dict[str, InFlight] = {}
        for scope_id, live in (await self.live_deploying_of(scope_ids)).items():
            warm = sum(m.startswith(WARM_TOKEN_PREFIX) for m in live)
            in_flight[scope_id] = InFlight(warm=warm, cold=len(live) - warm)
        return in_flight

    async def pod_counts_of(self, scope_ids: list[str]) -> dict[str, int]:
        """Each scope's registered pods, in use and warm (ZCARD, in slices)."""
        counts = await self._read_many([scope_pods_key(s) for s in scope_ids], "ZCARD")
        return {s: int(n) for s, n in zip(scope_ids, counts, strict=True)}

    async def deploy_times_of(self, scope_ids: list[str]) -> dict[str, list[float]]:
        """Each scope's recent deploy times, seconds (deploy_time.lua's list, in slices)."""
        lists = await self._read_many([scope_deploy_times_key(s) for s in scope_ids], "LRANGE")
        return {s: [float(x) for x in items] for s, items in zip(scope_ids, lists, strict=True)}

    async def budget_room(self) -> int:
        """Pods the installation's budget still allows: its limit less the live units."""
        return await self.state.budget.room()

    async def _members_of(
        self, scope_ids: list[str], key: Callable[[str], str]
    ) -> dict[str, list[str]]:
        sets = await self._read_many([key(s) for s in scope_ids], "SMEMBERS")
        return {s: sorted(members) for s, members in zip(scope_ids, sets, strict=True)}

    async def _read_many(self, keys: list[str], command: str) -> list[Any]:
        """One reply per key (``read_many`` script: HGETALL or SMEMBERS), SCRIPT_BATCH keys a
        call: one round trip and one reply parsed in C instead of a pipelined command each."""
        replies: list[Any] = [None] * len(keys)
        for positions in self.state.key_slices(keys, SCRIPT_BATCH):
            chunk = [keys[i] for i in positions]
            for i, reply in zip(
                positions, await self._read_many_script(keys=chunk, args=[command]), strict=True
            ):
                replies[i] = reply
        return replies

    # --- pods, in slices -----------------------------------------------------------------------

    async def all_pods(self) -> dict[str, str]:
        """Every indexed pod → its scope: the pod index, bucket by bucket (HSCAN): every
        bucket's first page in one pipeline (one round trip a node), then the rest of the
        buckets that hold more than a page."""
        pods: dict[str, str] = {}
        keys = [pods_index_key(bucket_tag(bucket)) for bucket in range(BUCKETS)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hscan(key, 0, count=BATCH)
            pages = cast(list[tuple[int, dict[str, str]]], await pipe.execute())
        for key, (cursor, page) in zip(keys, pages, strict=True):
            pods.update(page)
            while int(cursor):
                cursor, more = await self.redis.hscan(key, cursor, count=BATCH)
                pods.update(cast(dict[str, str], more))
        return pods

    async def pod_fields(
        self, pods: Mapping[str, str], *fields: str
    ) -> dict[str, list[str | None]]:
        """Some fields of many pods' infos (``pods``: pod id → scope id): the jobs' cheap
        read, one ``pod_fields`` script per SCRIPT_BATCH pods (each reply a flat list, n values
        per pod)."""
        n = len(fields)
        pod_ids = list(pods)
        keys = [pod_info_key(pods[p], p) for p in pod_ids]
        out: dict[str, list[str | None]] = {}
        for positions in self.state.key_slices(keys, SCRIPT_BATCH):
            flat = await self._pod_fields(keys=[keys[i] for i in positions], args=list(fields))
            out.update((pod_ids[i], flat[j * n : j * n + n]) for j, i in enumerate(positions))
        return out

    async def pod_versions(self, pods: Mapping[str, str]) -> dict[str, str | None]:
        return {p: version for p, (version,) in (await self.pod_fields(pods, "deploy_ver")).items()}

    async def pod_places(self, pods: Mapping[str, str]) -> dict[str, PodPlace]:
        """Where each pod runs, from its info. In slices."""
        fields = await self.pod_fields(pods, "cluster", "namespace")
        return {
            p: PodPlace(cluster or None, namespace) for p, (cluster, namespace) in fields.items()
        }

    async def pod_phases(self, pods: Mapping[str, str]) -> dict[str, PodPhase]:
        """Each pod's phase (in_use / idle) and scope, from its info. In slices."""
        fields = await self.pod_fields(pods, "phase", "scope_id")
        return {p: PodPhase(phase, scope_id) for p, (phase, scope_id) in fields.items()}

    async def idle_since(self, pods: Mapping[str, str]) -> dict[str, float]:
        """When each warm pod (``pods``: pod id → scope id) joined the warm pool (Redis
        seconds); a pod that is not warm is left out. MGETs of BATCH keys (on a Redis Cluster
        split by slot)."""
        since: dict[str, float] = {}
        pod_ids = list(pods)
        for i in range(0, len(pod_ids), BATCH):
            chunk = pod_ids[i : i + BATCH]
            keys = [pod_idle_since_key(pods[p], p) for p in chunk]
            if self._cluster:
                values = await self.redis.mget_nonatomic(keys)  # type: ignore[attr-defined]
            else:
                values = await self.redis.mget(keys)
            since.update((p, float(v)) for p, v in zip(chunk, values, strict=True) if v)
        return since

    # --- reclaim and watch: one pod ------------------------------------------------------------

    async def take_out_of_idle(self, scope_id: str, pod_id: str) -> bool:
        """Atomically leave the warm pool, only if still in it (reclaim, before deleting)."""
        removed = await self.redis.srem(scope_idle_key(scope_id), pod_id)
        if removed:
            await self.redis.delete(pod_idle_since_key(scope_id, pod_id))
        return bool(removed)

    async def purge(self, pod_id: str, scope_id: str | None = None) -> str | None:
        """Forget the pod (purge.lua: its keys), then drop it from the pod index and give back
        its budget unit; its scope (its info's), None if unknown. Without ``scope_id`` the
        index names the scope; a pod it does not name is registered nowhere (the index comes
        first)."""
        if scope_id is None and (scope_id := await self.state.scope_of_pod(pod_id)) is None:
            return None
        scope = await self._purge(
            keys=[
                pod_info_key(scope_id, pod_id),
                pod_idle_since_key(scope_id, pod_id),
                pod_health_fails_key(scope_id, pod_id),
                pod_drain_key(scope_id, pod_id),
                scope_pods_key(scope_id),
                scope_idle_key(scope_id),
            ],
            args=[pod_id],
        )
        await self.redis.zrem(scope_draining_key(scope_id), pod_id)  # its drain, if any
        if await self.state.scope_of_pod(pod_id) == scope_id:
            await self.state.unindex_pod(pod_id)
        await self.state.budget.release(scope_id, pod_id)  # after the index: see repair_budgets
        return cast(str | None, scope or None)

    async def count_health_failure(self, scope_id: str, pod_id: str) -> int:
        """One more failed probe; 0 if the pod has been forgotten meanwhile.

        A probe can race the pod's purge (reclaim, watch or reconcile of another tick or
        replica): checked AFTER the increment, so either the purge comes later and deletes the
        counter itself, or we see it gone and delete the counter we just made.
        """
        key = pod_health_fails_key(scope_id, pod_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, HEALTH_FAILS_TTL)
            fails, _ = await pipe.execute()
        if not await self.redis.exists(pod_info_key(scope_id, pod_id)):
            await self.redis.delete(key)
            return 0
        return int(fails)

    async def clear_health_failures(self, pods: Mapping[str, str]) -> None:
        """Drop the fail counters of ``pods`` (pod id → scope id)."""
        if pods:
            await self.redis.delete(*(pod_health_fails_key(s, p) for p, s in pods.items()))

    # --- reconcile's repairs -------------------------------------------------------------------

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
        (adopt.lua: within max_pods and, reserved first, the budgets when the scope has a
        config; as it is when it has none); ``cluster``: where it runs (None: the process
        default). The pod index first, as for a registration; the unit (the pod id) reserved
        between the script's two asks and confirmed after the adoption, given back after a
        refusal."""
        await self.state.index_pod(scope_id, pod_id)
        budget = self.state.budget

        async def adopt(reserved: bool) -> list[str]:
            return cast(list[str], await self._adopt(
                keys=registration_keys(scope_id, pod_id),
                args=[
                    pod_id, scope_id, pod_sse_url, pod_ip, namespace, deploy_ver,
                    cluster or "", "1" if reserved else "0",
                ],
            ))  # fmt: skip

        reply = await adopt(False)
        if reply[0] == "reserve":
            refused = await budget.reserve(scope_id, pod_id, ADOPT_RESERVATION)
            reply = ["budget_reached", refused] if refused is not None else reply
            if refused is None:
                try:
                    reply = await adopt(True)
                finally:
                    if reply[0] != "adopted":
                        await budget.release(scope_id, pod_id)
        action, *detail = reply
        if action == "adopted":
            await budget.confirm(scope_id, pod_id, pod_id)
        elif action != "known":  # refused: nothing registered, nothing indexed
            await self.state.unindex_pod(pod_id)
        return AdoptOutcome(cast(Any, action), detail[0] if detail else None)

    async def index_scopes(self) -> int:
        """Add to the index every scope whose config it lacks (a SCAN of the keyspace, never
        KEYS: run by reconcile, not by every tick); returns how many were added."""
        found = [
            sid
            async for key in self.redis.scan_iter(match=SCOPE_CONFIG_PATTERN, count=BATCH)
            if (sid := scope_of_config_key(key))
        ]
        by_bucket: dict[str, list[str]] = {}
        for scope_id in found:
            by_bucket.setdefault(scope_index_key(scope_id), []).append(scope_id)
        added = 0
        for key, scopes in by_bucket.items():
            for i in range(0, len(scopes), BATCH):
                added += int(await self.redis.sadd(key, *scopes[i : i + BATCH]))
        return added

    async def index_pods(self) -> tuple[int, int]:
        """Reconcile's repair of the pod index: every registered pod of a scope with a config
        is indexed (added), and a pod indexed but registered in no scope for two passes in a
        row (a crash between a purge and its index write; a registration that died before its
        script) leaves it (dropped: one seen once may be a registration in flight). Returns
        (added, dropped)."""
        indexed = await self.all_pods()
        scopes = await self.scopes_with_config()
        registered: dict[str, str] = {}
        for i in range(0, len(scopes), SCRIPT_BATCH):
            chunk = scopes[i : i + SCRIPT_BATCH]
            for scope_id, pods in (await self._zmembers_of(chunk)).items():
                registered.update(dict.fromkeys(pods, scope_id))
        # a pod registered after the index was read is indexed already: asked again
        missing = [p for p, s in registered.items() if indexed.get(p) != s]
        now_indexed = await self.state.scopes_of_pods(missing)
        added = 0
        for pod_id in missing:
            if now_indexed.get(pod_id) != (scope_id := registered[pod_id]):
                await self.state.index_pod(scope_id, pod_id)
                added += 1
        stray = {p for p, s in indexed.items() if registered.get(p) != s}
        if stray:  # a pod of a scope without config: registered if its info is there
            infos = await self.pod_fields({p: indexed[p] for p in stray}, "scope_id")
            stray = {p for p in stray if infos[p][0] is None}
        dropped = 0
        for pod_id in stray & self._unregistered:
            if await self.state.scope_of_pod(pod_id) == indexed[pod_id]:
                await self.state.unindex_pod(pod_id)
                dropped += 1
        self._unregistered = stray - self._unregistered
        return added, dropped

    async def _zmembers_of(self, scope_ids: list[str]) -> dict[str, list[str]]:
        """Each scope's registered pods (its pods ZSET), in pipelined ZRANGEs of one slot each."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in scope_ids:
                pipe.zrange(scope_pods_key(scope_id), 0, -1)
            replies = cast(list[list[str]], await pipe.execute())
        return dict(zip(scope_ids, replies, strict=True))

    async def repair_budgets(self) -> BudgetRepair:
        """Reconcile's repair of the budgets from the pools (which reconcile keeps equal to
        Kubernetes), scope by scope: a registered pod or a live placeholder not counted is
        counted; a pod's unit whose pod is neither registered nor indexed (a purge or a
        registration that died between its steps) is dropped; so is a unit of no scope, and
        a unit in a rule's ZSET whose scope is not linked to that rule. A scope's reservation
        is never dropped here: it lapses by itself. The budget is read before the pools (the
        global and the rules' units before the scopes'), so what is dropped was there before
        the pools were read without what it stands for. O(pods + scopes), REPAIR_SLICE scopes
        at a time."""
        budget = self.state.budget
        global_units = await budget.global_units()
        rule_units = await budget.rule_units()
        links = await budget.links()
        scopes = sorted(set(await self.scopes_with_config()) | set(links))
        counted: set[str] = set()  # the units of every scope, after the repair
        expected: dict[str, set[str]] = {}  # rule -> its scopes' units
        added = dropped = 0
        for i in range(0, len(scopes), REPAIR_SLICE):
            chunk = scopes[i : i + REPAIR_SLICE]
            units = await budget.units_of(chunk)
            pods = await self._zmembers_of(chunk)
            placeholders = await self._members_of(chunk, scope_deploying_key)
            now = await self.state.now()
            pods_of = {s: set(pods[s]) for s in chunk}
            candidates = [
                u for s in chunk for u, score in units[s].items()
                if score == INF and u not in pods_of[s]
            ]  # fmt: skip
            indexed = await self.state.scopes_of_pods(candidates)
            fixes = []
            for s in chunk:
                drop = [
                    u for u, score in units[s].items()
                    if score == INF and u not in pods_of[s] and indexed.get(u) != s
                ]  # fmt: skip
                add = dict.fromkeys(pods[s], "+inf")  # the script adds what is missing
                for member in placeholders[s]:
                    deadline = placeholder_deadline(member)
                    if deadline >= now:
                        unit = reservation_unit(s, token_of(member))
                        add[unit] = str(int(deadline) + RESERVATION_MARGIN)
                fixes.append(BudgetFix("scope", s, drop, add))
                kept = (set(units[s]) - set(drop)) | set(add)
                counted |= kept
                expected.setdefault(links.get(s, ""), set()).update(kept)
            a, d = await budget.repair(fixes)
            added, dropped = added + a, dropped + d
        fixes = [BudgetFix("stray", "", [u for u in global_units if u not in counted])]
        fixes += [
            BudgetFix("rule", rule, sorted(units - expected.get(rule, set())))
            for rule, units in rule_units.items()
        ]
        _, d = await budget.repair(fixes)
        return BudgetRepair(added, dropped + d)

    async def report_foreign(self, count: int, pods: dict[str, dict[str, Any]]) -> None:
        """Replace reconcile's report: ``count`` foreign pods seen, ``pods`` (a bounded number
        of them) by "{namespace}/{pod}"."""
        flat = [x for field, pod in pods.items() for x in (field, json.dumps(pod, sort_keys=True))]
        await self._foreign_report(keys=[FOREIGN_PODS_KEY, FOREIGN_COUNT_KEY], args=[count, *flat])
