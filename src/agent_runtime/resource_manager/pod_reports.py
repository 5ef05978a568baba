"""``PodReports``: a gateway's report that a pod's stream just failed (route's
``rawdata.failed_pod_id``), checked at once.

The session side asks (through the facade) only for a pod its session is bound to. The pod's
``/health`` is probed on its SSE address (``PROBE_TIMEOUT``); a pod that answers is healthy
and never touched. One that does not is dead when Kubernetes says so (``DeadPods.settle``:
missing, Failed, crash-looping … — the stream's and the pass's own judgement), or when this
failed probe is its second in a row (``HEALTH_FAILS_TO_DEAD``, the counter the watch pass
keeps: one failed probe alone is never proof, a pod may miss one under load); it is then
cleaned here, and the caller's route that follows answers ``rebound``. Otherwise it is
``suspect``: its failure is counted, and the next report (or pass) decides.

Bounded: one probe per pod per ``REPORT_WINDOW`` across every replica (``pod_report.lua``);
the reports that come meanwhile share its verdict — on this replica through a single flight,
from another replica by reading the window (for at most ``SHARED_WAIT``). A report never
costs more than one probe and one GET of the pod per pod and window, however many
sessions, gateways or replicas report it.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.dead_pods import HEALTH_FAILS_TO_DEAD, DeadPods
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import PodStatus, PodVerdict
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.report_state import ReportState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.single_flight import SingleFlight

log = logging.getLogger(__name__)

REPORT_WINDOW = 1.0  # seconds: one probe per pod per window, its verdict shared
PROBE_TIMEOUT = 1.0  # the report's /health probe
GET_TIMEOUT = 1.0  # the report's GET of the pod (after a failed probe only)
SHARED_WAIT = PROBE_TIMEOUT + GET_TIMEOUT + 0.5  # waiting for another replica's probe
SHARED_POLL = 0.05
PROBING = "probing"
_GET_FAILED = object()  # Kubernetes could not say (not "missing")


class PodReports:
    def __init__(
        self,
        *,
        state: ResourceState,
        k8s: K8sPodClient,
        dead_pods: DeadPods,
        default_namespace: str,
        metrics: Metrics | None = None,
    ) -> None:
        self._state = state
        self._reports = ReportState(state)
        self._jobs_state = PoolJobsState(state)
        self._k8s = k8s
        self._dead = dead_pods
        self._default_namespace = default_namespace
        self._probes = SingleFlight[str, PodVerdict]()
        metrics = metrics or Metrics()
        self._outcomes = {v: metrics.pod_reports.labels(v.value) for v in PodVerdict}

    async def check(self, pod_id: str) -> PodVerdict:
        """The reported pod's verdict; a dead one is cleaned before this returns."""
        verdict = await self._probes.run(pod_id, lambda: self._check(pod_id))
        self._outcomes[verdict].inc()
        return verdict

    async def _check(self, pod_id: str) -> PodVerdict:
        # the window is the pod's, under its scope: a pod the index does not name is not
        # registered (cleaned already, or never ours)
        scope_id = await self._state.scope_of_pod(pod_id)
        if scope_id is None:
            return PodVerdict.UNKNOWN
        claim = await self._reports.claim(scope_id, pod_id, REPORT_WINDOW)
        if not claim.probe:
            return await self._shared(scope_id, pod_id, claim.seen)
        verdict = await self._judge(scope_id, pod_id)
        await self._reports.answer(scope_id, pod_id, verdict.value)
        return verdict

    async def _shared(self, scope_id: str, pod_id: str, seen: str | None) -> PodVerdict:
        """The window's verdict, once the probe running on another replica gives it; a probe
        that never answers (its replica died) counts as suspect: nothing is done."""
        loop = asyncio.get_running_loop()
        until = loop.time() + SHARED_WAIT
        while seen == PROBING and loop.time() < until:
            await asyncio.sleep(SHARED_POLL)
            seen = await self._reports.seen(scope_id, pod_id)
        try:
            return PodVerdict(seen or "")
        except ValueError:
            return PodVerdict.SUSPECT

    async def _judge(self, scope_id: str, pod_id: str) -> PodVerdict:
        info = await self._state.pod_info(pod_id, scope_id)
        if info is None:
            return PodVerdict.UNKNOWN  # cleaned already (or never ours)
        address = urlsplit(info.pod_sse_url)
        if address.hostname and address.port and await self._probe(address.hostname, address.port):
            await self._jobs_state.clear_health_failures({pod_id: scope_id})
            return PodVerdict.HEALTHY
        namespace = info.namespace or self._default_namespace
        status = await self._get(pod_id, namespace, info.cluster)
        if status is not _GET_FAILED:
            listed = status if isinstance(status, PodStatus) else None
            if await self._dead.settle(
                pod_id, namespace, info.cluster, listed, by="report", scope_id=info.scope_id
            ):
                return PodVerdict.DEAD
        if await self._jobs_state.count_health_failure(scope_id, pod_id) >= HEALTH_FAILS_TO_DEAD:
            await self._dead.clean(
                pod_id, namespace, info.cluster, exists=True, why="half-dead", by="report",
                scope_id=info.scope_id,
            )  # fmt: skip
            return PodVerdict.DEAD
        return PodVerdict.SUSPECT

    async def _probe(self, host: str, port: int) -> bool:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                return await self._k8s.probe_health(host, port)
        except TimeoutError:
            return False

    async def _get(self, pod_id: str, namespace: str, cluster: str | None) -> object:
        """Kubernetes' view of the pod (None: it does not have it), or ``_GET_FAILED``."""
        try:
            async with asyncio.timeout(GET_TIMEOUT):
                return await self._k8s.get_pod(pod_id, namespace, cluster=cluster)
        except Exception as exc:  # not known: only the probes can say then
            log.info("pod %s: reported, but Kubernetes could not be asked: %s", pod_id, exc)
            return _GET_FAILED
