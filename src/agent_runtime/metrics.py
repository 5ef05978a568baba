"""Prometheus metrics with a registry per app (no process-global state, so two apps in one
test process do not collide). Request count and latency per endpoint and status; the
background jobs (runs, failures, time, last success, whether this replica leads), read from
the job runner when scraped."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.jobs import Job

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "MetricsMiddleware"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "agent_runtime_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "agent_runtime_http_request_seconds",
            "HTTP request latency by endpoint",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30),
        )

    def watch_jobs(self, jobs: Callable[[], list[Job]]) -> None:
        """Report the jobs ``jobs()`` returns at every scrape (empty before startup)."""
        self.registry.register(_JobCollector(jobs))

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
        start = time.perf_counter()

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)
