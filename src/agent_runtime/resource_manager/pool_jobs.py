"""``PoolJobs``: the pools' four periodic jobs — autoscale, reclaim (+ prune), watch, reconcile.

Each is one ``*_once`` tick run by ``jobs.JobRunner`` under its leader lock (``rm_autoscale``,
``rm_reclaim``, ``rm_watch``, ``rm_reconcile``). Invariant for all of them: a pod with a live
session is never deleted, except when Kubernetes says it is dead or it failed its health
checks twice. Hazard: reads of Redis and Kubernetes are not one snapshot, so their order
matters (see ``reconcile_once``), and a LIST that failed is never taken to mean "no pods".

Watch and reconcile go per place, a (cluster, namespace) pair (``places.py``): each pod is
looked for in the cluster it was recorded in (None: the process default), deleted there, and
its adoption records it; reconcile's orphans are ``orphans.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agent_runtime.jobs import BackgroundTasks
from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.dead_pods import HEALTH_FAILS_TO_DEAD, DeadPods
from agent_runtime.resource_manager.deploy_state import DeployState, warm_token
from agent_runtime.resource_manager.drains import Drains
from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import PodStatus
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.orphans import Orphans
from agent_runtime.resource_manager.places import Places
from agent_runtime.resource_manager.pod_events import (
    NoPodEvents,
    PodEventReason,
    PodEventSink,
    PodRef,
)
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.session_side import SessionSide
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state_values import PoolConfig
from agent_runtime.resource_manager.warm_policy import reclaimable
from agent_runtime.resource_manager.warm_targets import WarmTargets

log = logging.getLogger(__name__)
LEASE_WALK = 50  # scopes the prune looks at each pass whatever the leased index says

# YIELD_NOTE: the jobs run in the serving process; a loop over every pod (10k) between two
# awaits holds requests for its whole length, so the long ones yield now and then.
PROBE_CONCURRENCY = 16
DEFAULT_WARM_DEPLOY_CONCURRENCY = 64  # warm deploys one replica runs at once
DEFAULT_ADOPTED_POD_TTL = 600.0


class PoolJobs:
    def __init__(
        self,
        *,
        state: ResourceState,
        k8s: K8sPodClient,
        orchestrator: ResourceOrchestrator,
        sessions: SessionSide,
        default_namespace: str,
        namespaces: frozenset[str] | None = None,
        identity: PodIdentity,
        metrics: Metrics | None = None,
        adopted_pod_ttl: float = DEFAULT_ADOPTED_POD_TTL,
        drains: Drains | None = None,
        warm_deploy_concurrency: int = DEFAULT_WARM_DEPLOY_CONCURRENCY,
        events: PodEventSink | None = None,
    ) -> None:
        """``namespaces``: the allow-list reconcile may look for orphans in besides where our
        pods are (None: wherever pool configs say); ``identity``: tells our pods from others;
        ``adopted_pod_ttl``: how long a warm pod of a scope without a pool config is kept;
        ``drains``: where the watch sends pods Kubernetes drains (default: one of its own);
        ``warm_deploy_concurrency``: warm deploys this replica runs at once (each scope's
        also within the orchestrator's scope deploy concurrency, with its cold deploys);
        ``events``: where the jobs' decisions about pods are recorded (``pod_events.py``)."""
        self._events = events or NoPodEvents()
        self._state = state
        self._deploy_state = DeployState(state)
        self._jobs_state = PoolJobsState(state)
        self._k8s = k8s
        self._orchestrator = orchestrator
        self._sessions = sessions
        self._places = Places(
            jobs_state=self._jobs_state,
            k8s=k8s,
            default_namespace=default_namespace,
            namespaces=namespaces,
        )
        self._default_namespace = default_namespace
        self._metrics = metrics or Metrics()
        self._adopted_pod_ttl = adopted_pod_ttl
        self._lease_walk = 0  # where the prune's slow walk over every scope goes on
        self._orphans = Orphans(
            state=state,
            deploys=self._deploy_state,
            jobs_state=self._jobs_state,
            k8s=k8s,
            sessions=sessions,
            identity=identity,
            metrics=self._metrics,
            deploy_lease=orchestrator.deploy_lease,
            events=self._events,
        )
        self.drains = drains or Drains(
            state=state, k8s=k8s, sessions=sessions, default_namespace=default_namespace,
            metrics=self._metrics, events=self._events,
        )  # fmt: skip
        # the one "dead → clean, retired → drain" of the pass, the stream and the reports
        # (the wiring shares it)
        self.dead_pods = DeadPods(
            k8s=k8s, jobs_state=self._jobs_state, sessions=sessions, drains=self.drains,
            clock=state.now, metrics=self._metrics, events=self._events,
        )  # fmt: skip
        self._warm_deploys = BackgroundTasks()
        self._warm_targets = WarmTargets(jobs_state=self._jobs_state, sessions=sessions)
        self._warm_deploy_concurrency = warm_deploy_concurrency
        self._unused_last_pass: set[str] = set()

    # --- autoscale (scenario H) ----------------------------------------------------------------

    async def autoscale_once(self) -> int:
        """Refill each scope's warm pool with pods of its current version, as its
        ``warm_pool`` policy plans it (static: the min_idle_pods floor; predictive: the
        measured demand, warm_policy.py); returns deploys started. Deploys run in the
        background (a tick must stay short); their placeholders count against max_pods and
        against the plan while they run."""
        started = 0
        configs = {
            scope_id: config
            for scope_id, config in (await self._pool_configs()).items()
            if config.pod_spec is not None
            and (config.min_idle_pods > 0 or config.warm_pool == "predictive")
        }
        warm_of = await self._current_idle(configs)
        in_flight = await self._jobs_state.in_flight_of(list(configs))
        plans = await self._warm_targets.plans(configs, warm_of, in_flight)
        spent_rules: set[str] = set()  # rules whose pod budget refused this tick
        for scope_id, config in configs.items():
            assert config.pod_spec is not None
            if config.budget_rule and config.budget_rule in spent_rules:
                continue
            # the scope's deploys at once, cold and warm, stay within its deploy concurrency
            # (the plan counts the warm deploys in flight already)
            room = self._orchestrator.scope_deploy_concurrency - in_flight[scope_id].total
            for _ in range(min(plans[scope_id].deploy, room)):
                if len(self._warm_deploys) >= self._warm_deploy_concurrency:
                    return started
                token = warm_token()
                # the deploy renews it (a lease): a replica that dies frees it within seconds
                ttl = self._orchestrator.placeholder_ttl
                outcome = await self._deploy_state.try_placeholder(scope_id, token, ttl)
                if outcome.budget == "global":
                    return started  # the installation's pod budget: no scope may grow now
                if outcome.budget == "rule":
                    spent_rules.add(config.budget_rule)
                if outcome.member is None:
                    break  # at max_pods or its rule's budget
                self._spawn_warm_deploy(scope_id, config.pod_spec, outcome.member)
                started += 1
        return started

    def _spawn_warm_deploy(self, scope_id: str, pod_spec: dict[str, Any], placeholder: str) -> None:
        async def deploy() -> None:
            try:
                await self._orchestrator.deploy_and_register(
                    scope_id, pod_spec, placeholder, warm=True
                )
            except Exception as exc:  # the placeholder is given back; the next tick retries
                log.warning("scope %s: warm deploy failed: %s", scope_id, exc)

        self._warm_deploys.spawn(deploy(), name=f"warm-deploy:{scope_id}")

    async def wait_for_warm_deploys(self) -> None:
        await self._warm_deploys.wait()

    async def _current_idle(self, configs: dict[str, PoolConfig]) -> dict[str, dict[str, float]]:
        """Each scope's warm pods of its current version → idle_since; a pod under a drain
        (one pending keeps serving until its replacement is warm) counts for no floor."""
        idle, versions = await self._idle_with_versions(list(configs))
        leaving = await self.drains.under_drain()
        return {
            scope_id: {
                p: t
                for p, t in idle[scope_id].items()
                if versions.get(p) == c.deploy_ver and p not in leaving
            }
            for scope_id, c in configs.items()
        }

    async def _idle_with_versions(
        self, scope_ids: list[str]
    ) -> tuple[dict[str, dict[str, float]], dict[str, str | None]]:
        idle = await self._jobs_state.idle_pods_of(scope_ids)
        versions = await self._jobs_state.pod_versions({p: s for s, ps in idle.items() for p in ps})
        return idle, versions

    async def _pool_configs(self) -> dict[str, PoolConfig]:
        """Every scope's pool config: its index, then the configs, pipelined."""
        return await self._jobs_state.pool_configs(await self._jobs_state.scopes_with_config())

    # --- reclaim (scenario K) ------------------------------------------------------------------

    async def reclaim_once(self) -> int:
        """Delete warm pods of an old version at once, and current ones above the plan's floor
        once idle for its ``reclaim_after`` (static: above min_idle_pods, after pod_ttl;
        predictive: above what the demand asks for, after min(pod_ttl, the p90 deploy time));
        returns pods reclaimed."""
        now = await self._state.now()
        reclaimed = 0
        # warm pods first: only the scopes that have some need their config read
        scopes = await self._jobs_state.scopes_with_config()
        idle_of, versions = await self._idle_with_versions(scopes)
        configs = await self._jobs_state.pool_configs([s for s, idle in idle_of.items() if idle])
        current_of = {
            s: {p: t for p, t in idle_of[s].items() if versions.get(p) == c.deploy_ver}
            for s, c in configs.items()
        }
        predictive = [s for s, c in configs.items() if c.warm_pool == "predictive"]
        plans = await self._warm_targets.plans(
            configs, current_of, await self._jobs_state.in_flight_of(predictive)
        )
        for scope_id in configs:
            current = current_of[scope_id]
            old = [p for p in idle_of[scope_id] if p not in current]
            # the floor keeps the longest-idle ones: acquire takes the most recently idle
            decided = plans[scope_id]
            expired = reclaimable(decided.keep_idle, current, now, decided.reclaim_after)
            for pod_id in old:
                if await self._reclaim(scope_id, pod_id, "of an old version"):
                    reclaimed += 1
            for pod_id in expired:
                if await self._reclaim(
                    scope_id, pod_id, f"idle past {decided.reclaim_after:.0f}s above its plan"
                ):
                    reclaimed += 1
        return reclaimed

    async def reclaim_and_prune_once(self) -> int:
        """The ``rm_reclaim`` tick: reclaim, then prune what dead replicas left behind."""
        reclaimed = await self.reclaim_once()
        await self.prune_once()
        return reclaimed

    async def prune_once(self) -> int:
        """Follower seats and placeholders whose lease ran out (their replica died) leave
        every scope that took one (``lease_prune``); how many were dropped. Besides the
        scopes the leased index says are due, a slice of every scope (LEASE_WALK a pass, in
        turn): a scope whose mark was lost with a crashed replica is found within
        scopes / LEASE_WALK passes."""
        scopes = sorted(await self._jobs_state.scopes_with_config())
        if self._lease_walk >= len(scopes):
            self._lease_walk = 0
        walk = scopes[self._lease_walk : self._lease_walk + LEASE_WALK]
        self._lease_walk += LEASE_WALK
        pruned = await self._deploy_state.prune_leases(walk=walk)
        if pruned.seats or pruned.placeholders:
            log.info(
                "pruned %d follower seats and %d placeholders past their lease",
                pruned.seats, pruned.placeholders,
            )  # fmt: skip
        return pruned.seats + pruned.placeholders

    async def _reclaim(self, scope_id: str, pod_id: str, why: str) -> bool:
        # out of the pool first (only if still there), so no acquire can get a pod being deleted
        if not await self._jobs_state.take_out_of_idle(scope_id, pod_id):
            return False
        info = await self._state.pod_info(pod_id, scope_id)
        namespace = (info.namespace if info else None) or self._default_namespace
        try:
            await self._k8s.delete(pod_id, namespace, cluster=info.cluster if info else None)
        except Exception as exc:
            log.warning("pod %s: reclaim delete failed (%s); back to the pool", pod_id, exc)
            await self._state.release(scope_id, pod_id)
            return False
        self._events.record(
            PodRef(pod_id, namespace, "", info.cluster if info else None),
            PodEventReason.RECLAIMED,
            f"reclaimed from scope {scope_id}'s warm pool: {why}",
        )
        await self._forget(pod_id, scope_id)
        return True

    async def _forget(self, pod_id: str, scope_id: str | None = None) -> None:
        await self.dead_pods.forget(pod_id, scope_id)

    # --- watch (scenarios J, N) ----------------------------------------------------------------

    async def watch_once(self) -> int:
        """Clean pods Kubernetes reports missing or dead, and pods whose /health failed on
        two passes in a row; drain pods it deletes gracefully or whose node is cordoned
        (``pod_reading.pod_condition``: the one reading of a pod's state); returns pods
        cleaned. One LIST per place (cluster, namespace) that holds pods we know and one node
        LIST per cluster, the places listed at once (a slow cluster delays no other); a place
        whose LIST failed is skipped. The safety net under the watch stream (``pod_watch.py``):
        both judge through ``DeadPods``."""
        known = await self._places.pods_by_place()
        listings = await self._places.list_all(list(known))
        cordoned = await self.drains.cordoned_nodes({cluster for cluster, _ in listings})
        now = await self._state.now()
        cleaned = 0
        probes: list[tuple[str, str, PodStatus, str | None]] = []
        for (cluster, namespace), pods in known.items():
            listed = listings.get((cluster, namespace))
            if listed is None:
                continue
            for pod_id in pods:
                status = listed.get(pod_id)
                if await self.dead_pods.settle(
                    pod_id, namespace, cluster, status, by="pass",
                    cordoned_nodes=cordoned.get(cluster, ()), now=now,
                ):  # fmt: skip
                    cleaned += 1
                elif status is not None and status.phase == "Running" and status.pod_ip:
                    probes.append((pod_id, pods[pod_id], status, cluster))
        cleaned += await self._probe_all(probes)
        return cleaned

    async def _probe_all(self, probes: list[tuple[str, str, PodStatus, str | None]]) -> int:
        """PROBE_CONCURRENCY workers over the list (not a task per pod: 10k of them would be
        created in one go and stall the loop); their Redis calls too stay within that bound."""
        ports = {
            scope_id: int(config.pod_spec.get("sse_port") or 8080)
            for scope_id, config in (await self._pool_configs()).items()
            if config.pod_spec is not None
        }
        healthy_pods: list[tuple[str, str]] = []
        pending = iter(probes)
        cleaned = 0

        async def worker() -> None:
            nonlocal cleaned
            for n, (pod_id, scope_id, status, cluster) in enumerate(pending):  # one worker a pod
                if n % 16 == 15:
                    await asyncio.sleep(0)  # YIELD_NOTE: a probe answered without I/O
                port = ports.get(status.scope_id or "")
                if port is None or status.pod_ip is None:
                    continue
                if await self._k8s.probe_health(status.pod_ip, port):
                    healthy_pods.append((pod_id, scope_id))  # counters reset below, in batches
                elif (
                    await self._jobs_state.count_health_failure(scope_id, pod_id)
                    >= HEALTH_FAILS_TO_DEAD
                ):
                    await self.dead_pods.clean(
                        pod_id, status.namespace, cluster, exists=True, why="half-dead",
                        by="pass", scope_id=scope_id, uid=status.uid,
                    )  # fmt: skip
                    cleaned += 1

        await asyncio.gather(*(worker() for _ in range(min(PROBE_CONCURRENCY, len(probes)))))
        for i in range(0, len(healthy_pods), 500):
            await self._jobs_state.clear_health_failures(dict(healthy_pods[i : i + 500]))
        return cleaned

    # --- reconcile (scenario L) ----------------------------------------------------------------

    async def reconcile_once(self) -> dict[str, int]:
        """Redis vs Kubernetes, both ways, and pods the session side stopped using.

        Read order matters: Redis' pods BEFORE the LIST (a pod registered after it would look
        missing), placeholders and then the pod index AFTER it (a pod listed while still deploying
        has a placeholder, or is registered by then: never an orphan). Only live placeholders
        count: an expired one is a dead deployer's, whose pod is settled here. An orphan is
        adopted or deleted only when it is provably ours, a dead deploy leader's recorded pod
        only under that deploy's lease (``orphans.py``); a foreign one is counted.
        """
        counts = {"purged": 0, "released": 0, "adopted": 0, "deleted": 0, "expired": 0}
        indexed = await self._jobs_state.index_scopes()
        if indexed:
            log.info("%d scopes with a pool config were missing from the index; added", indexed)
        added, dropped = await self._jobs_state.index_pods()
        if added or dropped:
            log.warning("pod index drifted: %d pods added, %d dropped", added, dropped)
        if drained := await self.drains.index_drains(await self._jobs_state.all_pods()):
            log.warning("%d drains were missing from the draining pods; added", drained)
        known_before = await self._places.pods_by_place()
        places = set(known_before) | await self._places.config_places()
        listings = await self._places.list_all(sorted(places, key=lambda p: (p[0] or "", p[1])))
        for place, pods in known_before.items():
            listed = listings.get(place)
            if listed is None:
                continue
            for pod_id in pods:
                if pod_id not in listed:
                    await self._forget(pod_id)
                    counts["purged"] += 1
        counts["released"] = await self._release_unused()
        counts["expired"] = await self._expire_configless()
        # placeholders past their lease are a dead deployer's: its pod is adopted or deleted
        in_flight = await self._jobs_state.in_flight_of(await self._jobs_state.scopes_with_config())
        known_now = set(await self._jobs_state.all_pods())
        known_at_start = {p for pods in known_before.values() for p in pods}
        self._orphans.begin_pass()
        for (cluster, _), listed in listings.items():
            for n, status in enumerate(listed.values()):
                if n % 1000 == 999:
                    await asyncio.sleep(0)  # see YIELD_NOTE
                if status.pod_id in known_now or status.phase == "Terminating":
                    continue
                if status.pod_id in known_at_start:
                    continue  # forgotten during this pass (reclaimed, cleaned): not an orphan
                if self._orphans.foreign(status, cluster):
                    continue  # not provably ours: never adopted, never deleted
                if (deploys := in_flight.get(status.scope_id or "")) and deploys.total:
                    continue  # a deploy of that scope is in flight: maybe this very pod
                fate = await self._orphans.settle(status, cluster)
                if fate in counts:
                    counts[fate] += 1
        counts["foreign"] = await self._orphans.end_pass()
        for action, n in counts.items():
            self._metrics.reconciled.labels(action).inc(n)
        # last: the pools now match Kubernetes, and the budgets are made to match the pools
        repair = await self._jobs_state.repair_budgets()
        if repair.added or repair.dropped:
            log.warning(
                "pod budgets drifted: %d units added, %d dropped", repair.added, repair.dropped
            )
        return counts

    async def _release_unused(self) -> int:
        """In-use pods the session side neither places on nor has sessions on → warm pool."""
        view: dict[str, str] = {}
        phases = await self._jobs_state.pod_phases(await self._jobs_state.all_pods())
        for pod_id, pod in phases.items():
            if pod.phase == "in_use" and pod.scope_id:
                view[pod_id] = pod.scope_id
        if not view:
            return 0
        await asyncio.sleep(0)  # see YIELD_NOTE
        usage = await self._sessions.reconcile_pods(view)
        await asyncio.sleep(0)
        unused = {p for p in view if (use := usage.get(p)) is None or use.unused}
        # Two passes in a row: a pod just handed out by acquire is in use before the session
        # side registers it; one pass could catch it in between and release a pod about to
        # take sessions.
        confirmed, self._unused_last_pass = unused & self._unused_last_pass, unused
        released = 0
        for pod_id in confirmed:
            if await self._state.release(view[pod_id], pod_id):
                released += 1
        return released

    async def _expire_configless(self) -> int:
        """Warm pods of a scope without a pool config go once idle for ``adopted_pod_ttl``:
        pods adopted after a Redis data loss whose scope never routed again (its route would
        have written the config, and the normal reclaim rules would apply). O(pods) in slices."""
        configured = set(await self._jobs_state.scopes_with_config())
        phases = await self._jobs_state.pod_phases(await self._jobs_state.all_pods())
        waiting = {
            pod_id: pod.scope_id
            for pod_id, pod in phases.items()
            if pod.phase == "idle" and pod.scope_id and pod.scope_id not in configured
        }
        if not waiting:
            return 0
        now = await self._state.now()
        ttl = self._adopted_pod_ttl
        since = await self._jobs_state.idle_since(waiting)
        expired = 0
        for pod_id, scope_id in waiting.items():
            if pod_id in since and now - since[pod_id] >= self._adopted_pod_ttl:
                log.info("pod %s: scope %s has no pool config; its warm pod goes", pod_id, scope_id)
                if await self._reclaim(
                    scope_id, pod_id, f"its scope has no pool config (idle past {ttl:.0f}s)"
                ):
                    expired += 1
        return expired
