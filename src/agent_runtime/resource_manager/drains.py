"""``Drains``: retiring a pod, or every pod on a node, without cutting its conversations.

A drain takes the pod out of the placement candidates at once — out of its scope's warm pool
in the RM (``drain_begin.lua``: marked and taken out in one step) and out of every scope's
candidates on the session side (``SessionSide.retire_pod``, as a sunset pod) — and leaves its
sessions where they are until they end or until the drain's deadline; from then on each one
left is evicted as for a dead pod (``SessionSide.notify_pod_dead``: its next route answers
``rebound`` with ``previous_pod_id``) and the pod is deleted. An empty pod is deleted at once.

Triggers: an operator (``drain_pod``, ``drain_node``: the admin calls), Kubernetes' graceful
deletion of the pod (deadline: when Kubernetes will kill it, minus a margin) and a cordon of
its node (the default timeout) — both seen by the watch through ``pod_reading.pod_condition``.

The floor: a warm pod the scope's ``min_idle_pods`` needs is not drained at once; its drain
is ``pending`` (the pod still serves) while autoscale, which counts no pod under a drain,
warms a replacement; it drains once the floor holds without it, once it is in use anyway,
after the replacement's deploy time, or at its deadline. A graceful deletion never waits.

The ``rm_drains`` job (``drains_once``, leader-locked) moves drains along. Idempotent
everywhere: a second drain of a pod keeps the first one (a deadline only comes forward).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.drain_state import DrainState
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import K8sApiError
from agent_runtime.resource_manager.places import Places
from agent_runtime.resource_manager.pod_events import (
    NoPodEvents,
    PodEventReason,
    PodEventSink,
    PodRef,
)
from agent_runtime.resource_manager.pod_manifest import deploy_timing
from agent_runtime.resource_manager.pod_reading import PodCondition
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.session_side import SessionSide
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state_values import Drain, PodInfo

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT = 300.0
DEFAULT_DRAIN_MARGIN = 2.0
MAX_DRAIN_SECONDS = 86_400  # a drain deadline is at most a day away
REPLACEMENT_SLACK = 10.0  # seconds past the template's ready_timeout a pending drain waits
# a drain's trigger as its pod's Events say it
_TRIGGERS = {
    "admin": "an admin drain of the pod or its node",
    "cordon": "its node is cordoned",
    "graceful_delete": "Kubernetes is deleting it gracefully",
}


def _clock_time(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class DrainStatus:
    """One pod's drain as an operator sees it (the facade's answer)."""

    pod_id: str
    state: Literal["pending", "draining", "deleted"]
    trigger: str
    deadline: float  # Unix seconds (Redis' clock)
    started: bool  # this call began it (False: one was under way)
    sessions: int  # live sessions it still carries


class Drains:
    def __init__(
        self,
        *,
        state: ResourceState,
        k8s: K8sPodClient,
        sessions: SessionSide,
        default_namespace: str,
        metrics: Metrics | None = None,
        default_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        margin: float = DEFAULT_DRAIN_MARGIN,
        events: PodEventSink | None = None,
    ) -> None:
        self._state = state
        self._events = events or NoPodEvents()
        self._drain_state = DrainState(state)
        self._jobs_state = PoolJobsState(state)
        self._k8s = k8s
        self._sessions = sessions
        self._places = Places(
            jobs_state=self._jobs_state, k8s=k8s, default_namespace=default_namespace,
            namespaces=None,
        )  # fmt: skip
        self._default_namespace = default_namespace
        self._metrics = metrics or Metrics()
        self.default_timeout = default_timeout
        self.margin = margin
        self._nodes_refused: set[str | None] = set()  # clusters whose node LIST was refused

    # --- the operator's calls ------------------------------------------------------------------

    async def drain_pod(self, pod_id: str, seconds: float | None = None) -> DrainStatus | None:
        """Drain one pod of ours (``seconds``: its deadline from now; None: the default);
        None when the pod is not registered (unknown, or not ours)."""
        info = await self._state.pod_info(pod_id)
        if info is None:
            return None
        return await self._begin(pod_id, info, "admin", seconds=self._bounded(seconds))

    async def drain_node(self, node: str, seconds: float | None = None) -> list[DrainStatus]:
        """Drain every pod of ours on ``node``, in every place (cluster, namespace) that holds
        pods of ours: one LIST each; a place whose LIST failed → ``K8sApiError`` (a node
        drain that silently skipped pods would be worse than one refused)."""
        known = await self._places.pods_by_place()
        listings = await self._places.list_all(list(known))
        if len(listings) < len(known):
            raise K8sApiError("a pod list failed: the node's pods are not all known")
        drained: list[DrainStatus] = []
        for place, pods in known.items():
            listed = listings[place]
            for pod_id in pods:
                status = listed.get(pod_id)
                if status is None or status.node != node:
                    continue
                info = await self._state.pod_info(pod_id, pods[pod_id])
                if info is not None:
                    begun = await self._begin(pod_id, info, "admin", seconds=self._bounded(seconds))
                    drained.append(begun)
        return drained

    def _bounded(self, seconds: float | None) -> float:
        chosen = self.default_timeout if seconds is None else seconds
        return min(max(chosen, 0.0), MAX_DRAIN_SECONDS)

    # --- the watch's: Kubernetes drains a pod ----------------------------------------------------

    async def drain_seen(self, pod_id: str, condition: PodCondition) -> None:
        """The watch saw a pod being deleted gracefully or on a cordoned node. A drain under
        way is left as it is unless this one's deadline is earlier."""
        existing = await self._drain_state.drain_of(pod_id)
        trigger = condition.trigger or "cordon"
        if (
            existing is not None
            and existing.state == "draining"
            and (condition.deadline is None or condition.deadline >= existing.deadline)
        ):
            return
        info = await self._state.pod_info(pod_id)
        if info is None:
            return
        if condition.deadline is not None:
            await self._begin(pod_id, info, trigger, deadline=condition.deadline)
        else:
            await self._begin(pod_id, info, trigger, seconds=self.default_timeout)

    async def cordoned_nodes(self, clusters: set[str | None]) -> dict[str | None, set[str]]:
        """Each cluster's cordoned nodes; a cluster whose node LIST fails (e.g. the service
        may not read nodes: 403) is left out, logged once until it answers again."""
        found: dict[str | None, set[str]] = {}
        for cluster in clusters:
            try:
                nodes = await self._k8s.list_nodes(cluster=cluster)
            except (K8sApiError, OSError, TimeoutError) as exc:
                if cluster not in self._nodes_refused:
                    self._nodes_refused.add(cluster)
                    log.warning("cluster %s: nodes not listed (%s); cordons go unseen",
                                cluster or "(default)", exc)  # fmt: skip
                continue
            self._nodes_refused.discard(cluster)
            found[cluster] = {n.name for n in nodes if n.unschedulable}
        return found

    # --- beginning a drain ---------------------------------------------------------------------

    async def _begin(
        self,
        pod_id: str,
        info: PodInfo,
        trigger: str,
        *,
        seconds: float | None = None,
        deadline: float | None = None,
    ) -> DrainStatus:
        # a graceful deletion kills the pod whatever we do: it never waits for a replacement
        pending = trigger != "graceful_delete" and await self._floor_needs(pod_id, info)
        begun = await self._drain_state.begin(
            pod_id, info.scope_id, trigger=trigger, pending=pending, seconds=seconds,
            deadline=deadline,
        )  # fmt: skip
        if begun is None:  # purged meanwhile: gone already
            return DrainStatus(pod_id, "deleted", trigger, 0.0, False, 0)
        if begun.started:
            self._metrics.drains_started.labels(begun.trigger).inc()
            log.info("pod %s: drain begun (%s, %s), deadline %.0f",
                     pod_id, begun.trigger, begun.state, begun.deadline)  # fmt: skip
            waits = " (waits for a replacement first)" if begun.state == "pending" else ""
            self._events.record(
                PodRef(pod_id, info.namespace or self._default_namespace, "", info.cluster),
                PodEventReason.DRAIN_STARTED,
                f"drain begun ({_TRIGGERS.get(begun.trigger, begun.trigger)}){waits}: no new "
                f"sessions; the rest leave by {_clock_time(begun.deadline)}",
            )
        if begun.state == "pending":
            return DrainStatus(pod_id, "pending", begun.trigger, begun.deadline, begun.started, 0)
        sessions = await self._sessions.retire_pod(info.scope_id, pod_id)
        if sessions == 0 and await self._finish(info.scope_id, pod_id, begun.trigger, "empty"):
            return DrainStatus(pod_id, "deleted", begun.trigger, begun.deadline, begun.started, 0)
        state: Literal["draining"] = "draining"
        return DrainStatus(pod_id, state, begun.trigger, begun.deadline, begun.started, sessions)

    async def _floor_needs(self, pod_id: str, info: PodInfo) -> bool:
        """Whether the scope's warm floor counts on this pod: it is warm, of the current
        version, and without it fewer than ``min_idle_pods`` warm pods (none of them under
        a drain) are left."""
        if info.phase != "idle":
            return False
        config = await self._state.pool_config(info.scope_id)
        if config is None or config.min_idle_pods <= 0 or info.deploy_ver != config.deploy_ver:
            return False
        idle = await self._jobs_state.idle_pods(info.scope_id)
        others = [p for p in idle if p != pod_id]
        versions = await self._jobs_state.pod_versions(dict.fromkeys(others, info.scope_id))
        under_drain = {d.pod_id for d in await self._drain_state.drains(others)}
        warm = [p for p in others if versions.get(p) == config.deploy_ver and p not in under_drain]
        return len(warm) < config.min_idle_pods

    # --- the rm_drains job ---------------------------------------------------------------------

    async def drains_once(self) -> int:
        """Move every drain along; returns pods deleted. Pending: drain once the floor holds
        without it (or the wait is over). Draining: retire it again (a registration that
        raced the start leaves too), delete it when empty, at its deadline evict what is left
        (rebound) and delete it."""
        now = await self._state.now()
        finished = 0
        listed = await self._drain_state.draining_pods()
        drains = await self._drain_state.drains(listed)
        if stale := set(listed) - {d.pod_id for d in drains}:
            await self._drain_state.drop_stale(stale)
        for drain in drains:
            try:
                if drain.state == "pending" and not await self._pending_over(drain, now):
                    continue
                if drain.state == "pending":
                    begun = await self._drain_state.begin(
                        drain.pod_id, drain.scope_id, trigger=drain.trigger, pending=False,
                        deadline=drain.deadline,
                    )  # fmt: skip
                    if begun is None:
                        continue
                sessions = await self._sessions.retire_pod(drain.scope_id, drain.pod_id)
                if sessions == 0 or now >= drain.deadline:
                    outcome = "empty" if sessions == 0 else "deadline"
                    finished += await self._finish(
                        drain.scope_id, drain.pod_id, drain.trigger, outcome
                    )
            except Exception as exc:  # one pod's failure holds up no other; next tick retries
                log.warning("pod %s: drain step failed: %s", drain.pod_id, exc)
        return finished

    async def _pending_over(self, drain: Drain, now: float) -> bool:
        if now >= drain.deadline:
            return True
        info = await self._state.pod_info(drain.pod_id, drain.scope_id or None)
        if info is None or not await self._floor_needs(drain.pod_id, info):
            return True
        config = await self._state.pool_config(info.scope_id)
        wait = deploy_timing(config.pod_spec)[0] if config and config.pod_spec else 0.0
        return now >= drain.since + wait + REPLACEMENT_SLACK

    async def _finish(self, scope_id: str, pod_id: str, trigger: str, outcome: str) -> bool:
        """Evict what is left (rebound at the next route), delete the pod, forget it. False
        when Kubernetes could not be asked: the drain stays, the next tick tries again."""
        evicted = await self._sessions.notify_pod_dead(scope_id, pod_id)
        info = await self._state.pod_info(pod_id, scope_id)
        if info is not None:
            namespace = info.namespace or self._default_namespace
            try:
                await self._k8s.delete(pod_id, namespace, cluster=info.cluster)
            except Exception as exc:
                log.warning("pod %s: drain delete failed (%s); tried again", pod_id, exc)
                return False
        await self._jobs_state.purge(pod_id, scope_id)
        self._metrics.drains_finished.labels(trigger or "admin", outcome).inc()
        if info is not None:
            left = "every session left" if outcome == "empty" else "its time ran out"
            self._events.record(
                PodRef(pod_id, info.namespace or self._default_namespace, "", info.cluster),
                PodEventReason.DRAINED,
                f"drained and deleted ({_TRIGGERS.get(trigger, trigger or 'admin')}): {left}; "
                f"{evicted} sessions rebound",
            )
        log.info("pod %s: drained (%s, %s), %d sessions rebound", pod_id, trigger, outcome, evicted)
        return True

    # --- reads ---------------------------------------------------------------------------------

    async def index_drains(self, pods: dict[str, str]) -> int:
        """Reconcile's repair of the draining pods: every drain of ``pods`` listed."""
        return await self._drain_state.index_drains(pods)

    async def under_drain(self) -> set[str]:
        """Every pod under a drain (pending or draining): autoscale counts none of them."""
        return set(await self._drain_state.draining_pods())
