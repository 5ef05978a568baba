"""Prometheus metrics with a registry per app (no process-global state, so two apps in one
test process do not collide).

Requests (count and latency per endpoint and status), placements, the wait queue, the pod
pool (acquires by source, deploys by outcome and duration, follower waits), the backends
(Redis scripts, DB calls and Kubernetes calls: latency and errors), and the background jobs
(read from the job runner at scrape time). Every label value comes from a small fixed set,
never from a request (bounded cardinality); per-scope series are opt-in (``scope_metrics``).
Families are created once; hot paths hold their labelled children (no per-call lookups).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.jobs import Job

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "MetricsMiddleware"]

_ERROR_CODE = b"x-error-code"  # answers.ERROR_CODE_HEADER, as ASGI gives header names
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)
SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "agent_runtime_http_requests",
            "HTTP requests by endpoint, status and outcome (OK or the contract's error code)",
            ["endpoint", "status", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "agent_runtime_http_request_seconds",
            "HTTP request latency by endpoint",
            ["endpoint"],
            registry=self.registry,
            buckets=FAST_BUCKETS,
        )
        # --- session manager
        self.placements = Counter(
            "agent_runtime_route_placements",
            "routes answered, by placement (refresh / placed / rebound / replay)",
            ["placement"],
            registry=self.registry,
        )
        self.queue_outcomes = Counter(
            "agent_runtime_queue_outcomes",
            "routes that had to wait, by how the wait ended",
            ["outcome"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "agent_runtime_queue_wait_seconds",
            "time a route spent on its slow path before its answer",
            registry=self.registry,
            buckets=SLOW_BUCKETS,
        )
        # --- resource manager
        self.acquires = Counter(
            "agent_runtime_pool_acquires",
            "acquire outcomes: warm (reused), deploy (led one), follower, replay, "
            "max_pods, budget, in_progress, timeout (the caller's deadline), failed",
            ["source"],
            registry=self.registry,
        )
        self.dead_pods_cleaned = Counter(
            "agent_runtime_dead_pods_cleaned",
            "dead pods cleaned (sessions evicted), by the door that found them: pass (the "
            "periodic watch), stream (the watch stream), report (a gateway's failed_pod_id)",
            ["by"],
            registry=self.registry,
        )
        self.pod_watch_events = Counter(
            "agent_runtime_pod_watch_events",
            "pod watch stream events seen, by type (ADDED, MODIFIED, DELETED, BOOKMARK)",
            ["type"],
            registry=self.registry,
        )
        self.pod_watch_relists = Counter(
            "agent_runtime_pod_watch_relists",
            "LISTs a watch stream (re)started from: its start, a 410, an error",
            registry=self.registry,
        )
        self.pod_watch_restarts = Counter(
            "agent_runtime_pod_watch_restarts",
            "watch streams that ended, by reason: ended (the server's timeout or a dropped "
            "connection: resumed), expired (410: listed again), error (listed again after a "
            "backoff)",
            ["reason"],
            registry=self.registry,
        )
        self.pod_watch_streams = Gauge(
            "agent_runtime_pod_watch_streams",
            "watch streams open on this replica (0 unless it leads rm_pod_watch)",
            registry=self.registry,
        )
        self.pod_reports = Counter(
            "agent_runtime_pod_reports",
            "routes carrying rawdata.failed_pod_id, by outcome: ignored (the session is not "
            "on that pod), healthy, suspect, dead (cleaned and rebound), unknown",
            ["outcome"],
            registry=self.registry,
        )
        self.deploy_claims = Counter(
            "agent_runtime_pool_deploy_claims",
            "cold claims (deploy_claim.lua): lead (a new or lapsed deploy), follow (a seat in "
            "a deploy in flight), busy (the scope's deploy concurrency reached), coming "
            "(no slot, a deploy under way), max_reached, budget_reached",
            ["outcome"],
            registry=self.registry,
        )
        self.deploys = Counter(
            "agent_runtime_pool_deploys",
            "pod deploys by kind (cold / warm) and outcome",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.takeovers = Counter(
            "agent_runtime_pool_deploy_takeovers",
            "deploys taken over from a leader whose lease lapsed (its replica died), by what "
            "became of its pod: adopted, deployed (gone or of an old version: a new one "
            "deployed), failed (dead or not Ready in time: deleted)",
            ["outcome"],
            registry=self.registry,
        )
        self.deploy_seconds = Histogram(
            "agent_runtime_pool_deploy_seconds",
            "time from create to Ready and registered",
            ["kind"],
            registry=self.registry,
            buckets=SLOW_BUCKETS,
        )
        self.follower_waits = Histogram(
            "agent_runtime_pool_follower_wait_seconds",
            "time a follower waited for its leader's pod",
            registry=self.registry,
            buckets=SLOW_BUCKETS,
        )
        self.reconciled = Counter(
            "agent_runtime_reconcile_pods",
            "pods reconcile acted on, by action: purged (gone from Kubernetes), released "
            "(unused, to the warm pool), adopted / deleted (ours, unknown to Redis), foreign "
            "(not provably ours: left alone; each pass that sees one counts it)",
            ["action"],
            registry=self.registry,
        )
        self.pod_events = Counter(
            "agent_runtime_pod_events",
            "Kubernetes Events about pods (resource_manager/pod_events.py), by reason and "
            "outcome: sent (created), aggregated (an occurrence more, patched), dropped_full "
            "(queue full), dropped_spam (the per-pod rate limit), dropped_stop, failed",
            ["reason", "outcome"],
            registry=self.registry,
        )
        self.foreign_pods = Counter(
            "agent_runtime_foreign_pods",
            "pods with our labels that are not provably ours (identity), first seen by this "
            "replica's reconcile: never adopted, routed to or deleted",
            registry=self.registry,
        )
        self.drains_started = Counter(
            "agent_runtime_drains_started",
            "pod drains begun, by trigger: admin, graceful_delete (Kubernetes deletes the pod "
            "with a grace period), cordon (its node was cordoned)",
            ["trigger"],
            registry=self.registry,
        )
        self.drains_finished = Counter(
            "agent_runtime_drains_finished",
            "drained pods deleted, by trigger and outcome: empty (its sessions had ended) or "
            "deadline (the sessions left were rebound)",
            ["trigger", "outcome"],
            registry=self.registry,
        )
        # --- backends
        self.redis_seconds = Histogram(
            "agent_runtime_redis_script_seconds",
            "Lua script calls (EVALSHA) by script",
            ["script"],
            registry=self.registry,
            buckets=FAST_BUCKETS,
        )
        self.redis_errors = Counter(
            "agent_runtime_redis_errors",
            "Redis calls that failed, by script",
            ["script"],
            registry=self.registry,
        )
        self.redis_wait_short = Counter(
            "agent_runtime_redis_wait_short",
            "WAITs after an admission script (AGENT_RUNTIME_REDIS_WAIT_REPLICAS) that saw "
            "fewer replicas acknowledge the write than asked, within the timeout, by script",
            ["script"],
            registry=self.registry,
        )
        self.index_writes = Counter(
            "agent_runtime_index_writes",
            "Writes a route or a touch asks of keys outside its script's slot (the session-scope "
            "index, expiry marks, a moved session's eviction), done after the reply, by outcome: "
            "written, failed, waited (for room: the bound reached), dropped, inline (at stop)",
            ["outcome"],
            registry=self.registry,
        )
        self.db_seconds = Histogram(
            "agent_runtime_db_seconds",
            "SQL calls by kind (read / write)",
            ["op"],
            registry=self.registry,
            buckets=FAST_BUCKETS,
        )
        self.db_errors = Counter(
            "agent_runtime_db_errors", "SQL calls that failed", ["op"], registry=self.registry
        )
        self.k8s_calls = Counter(
            "agent_runtime_k8s_calls",
            "Kubernetes adapter calls by verb and outcome (ok or the error's status)",
            ["verb", "status"],
            registry=self.registry,
        )
        self.k8s_seconds = Histogram(
            "agent_runtime_k8s_call_seconds",
            "Kubernetes adapter call latency by verb",
            ["verb"],
            registry=self.registry,
            buckets=SLOW_BUCKETS,
        )
        # --- state, set at scrape time (see main: /metrics)
        self.pods = Gauge("agent_runtime_pods", "pods by state", ["state"], registry=self.registry)
        self.sessions = Gauge(
            "agent_runtime_live_sessions", "live sessions (all scopes)", registry=self.registry
        )
        self.pod_budget_used = Gauge(
            "agent_runtime_pod_budget_used",
            "units of the installation's pod budget in use: pods + deploys in flight "
            "(AGENT_RUNTIME_POD_BUDGET is the limit)",
            registry=self.registry,
        )
        self.foreign_pods_seen = Gauge(
            "agent_runtime_foreign_pods_seen",
            "foreign pods (our labels, no valid identity) the last reconcile pass saw",
            registry=self.registry,
        )
        self.scope_sessions = Gauge(
            "agent_runtime_scope_live_sessions",
            "live sessions per scope (only with scope_metrics)",
            ["scope"],
            registry=self.registry,
        )

    def redis_call(self, script: str) -> Callable[[float, bool], None]:
        """An observer for one script: (seconds, ok)."""
        timer, errors = self.redis_seconds.labels(script), self.redis_errors.labels(script)

        def observe(seconds: float, ok: bool) -> None:
            timer.observe(seconds)
            if not ok:
                errors.inc()

        return observe

    def db_call(self, op: str, seconds: float, ok: bool) -> None:
        self.db_seconds.labels(op).observe(seconds)
        if not ok:
            self.db_errors.labels(op).inc()

    def k8s_call(self, verb: str, status: str, seconds: float) -> None:
        self.k8s_calls.labels(verb, status).inc()
        self.k8s_seconds.labels(verb).observe(seconds)

    def watch_jobs(self, jobs: Callable[[], list[Job]]) -> None:
        """Report the jobs ``jobs()`` returns at every scrape (empty before startup)."""
        self.registry.register(_JobCollector(jobs))

    def watch_admission(self, counts: Callable[[], tuple[int, int, int, int]]) -> None:
        """The edge's in-flight bound at every scrape: ``counts()`` is (admitted, parked,
        waiting for a place, the working bound)."""
        self.registry.register(_AdmissionCollector(counts))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _JobCollector(Collector):
    def __init__(self, jobs: Callable[[], list[Job]]) -> None:
        self._jobs = jobs

    def collect(self) -> Iterator[Metric]:
        runs = CounterMetricFamily("agent_runtime_job_runs", "job ticks run here", labels=["job"])
        failures = CounterMetricFamily(
            "agent_runtime_job_failures", "job ticks that failed here", labels=["job"]
        )
        seconds = CounterMetricFamily(
            "agent_runtime_job_seconds", "time spent in job ticks here", labels=["job"]
        )
        last = GaugeMetricFamily(
            "agent_runtime_job_last_success_timestamp_seconds",
            "wall clock of the last successful tick here (0: none yet)",
            labels=["job"],
        )
        leading = GaugeMetricFamily(
            "agent_runtime_job_leader", "1 while this replica leads the job", labels=["job"]
        )
        for job in self._jobs():
            runs.add_metric([job.name], job.runs)
            failures.add_metric([job.name], job.failures)
            seconds.add_metric([job.name], job.seconds)
            last.add_metric([job.name], job.last_success or 0.0)
            leading.add_metric([job.name], 1.0 if job.leading else 0.0)
        yield from (runs, failures, seconds, last, leading)


class _AdmissionCollector(Collector):
    def __init__(self, counts: Callable[[], tuple[int, int, int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        active, parked, waiting, limit = self._counts()
        yield GaugeMetricFamily(
            "agent_runtime_http_in_flight_limit",
            "the working in-flight bound: AGENT_RUNTIME_MAX_IN_FLIGHT, lowered while the event "
            "loop runs late (AGENT_RUNTIME_ADMISSION_LAG_TARGET)",
            value=limit,
        )
        yield GaugeMetricFamily(
            "agent_runtime_http_in_flight",
            "API requests at work now (counted against AGENT_RUNTIME_MAX_IN_FLIGHT)",
            value=active,
        )
        yield GaugeMetricFamily(
            "agent_runtime_http_parked",
            "API requests waiting (scope queue, deploy) that gave their in-flight place back",
            value=parked,
        )
        yield GaugeMetricFamily(
            "agent_runtime_http_admission_waiting",
            "API requests over the in-flight bound waiting for a place",
            value=waiting,
        )


class MetricsMiddleware:
    """Counts every HTTP request by route path (known paths only: bounded cardinality)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, known_paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.known_paths else "other"
        status = 500
        code = "INTERNAL"
        start = time.perf_counter()

        async def record(message: Message) -> None:
            nonlocal status, code
            if message["type"] == "http.response.start":
                status = message["status"]
                code = "OK" if status < 400 else f"HTTP_{status}"
                for name, value in message.get("headers", ()):
                    if name.lower() == _ERROR_CODE:  # set by answers.failure: a fixed set
                        code = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.requests.labels(path, str(status), code).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)
