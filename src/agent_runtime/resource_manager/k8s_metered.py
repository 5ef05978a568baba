"""``MeteredK8sPodClient``: any ``K8sPodClient``, each call counted and timed (the wiring
wraps the real or fake client in it; metrics ``agent_runtime_k8s_calls_total`` and
``agent_runtime_k8s_call_seconds``) and, with tracing on, one CLIENT span each
(``k8s <verb>``, under whatever span is current: a route's acquire, a job's tick)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s import K8sPodClient, OnCreated
from agent_runtime.resource_manager.models import (
    DeployFailed,
    K8sApiError,
    NodeStatus,
    PodDeployInfo,
    PodEvent,
    PodListing,
    PodStatus,
)
from agent_runtime.tracing import Tracing

T = TypeVar("T")
K8S_OUTCOME = "agent_runtime.k8s.outcome"  # the metrics' outcome label, on the call's span


class MeteredK8sPodClient:
    """Any ``K8sPodClient``, each call counted by verb and outcome and timed (metrics).

    Outcomes: ``ok``, the HTTP status of a refusal (``K8sApiError``), ``deploy_failed``,
    ``timeout``, ``error``: a small fixed set, whatever the error text.
    """

    def __init__(
        self,
        inner: K8sPodClient,
        observe: Callable[[str, str, float], None],
        *,
        tracing: Tracing | None = None,
    ) -> None:
        self.inner = inner
        self._observe = observe
        self._tracing = tracing or Tracing()

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def _timed(self, verb: str, call: Awaitable[T]) -> T:
        started = time.perf_counter()
        status = "error"
        with self._tracing.span(f"k8s {verb}", kind="client") as span:
            try:
                result = await call
                status = "ok"
                return result
            except K8sApiError as exc:
                status = str(exc.status) if exc.status else "error"
                raise
            except DeployFailed:
                status = "deploy_failed"
                raise
            except TimeoutError:
                status = "timeout"
                raise
            finally:
                self._observe(verb, status, time.perf_counter() - started)
                span.set_attribute(K8S_OUTCOME, status)

    async def deploy(
        self,
        *,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
        identity: PodIdentity,
        on_created: OnCreated | None = None,
    ) -> PodDeployInfo:
        call = self.inner.deploy(
            scope_id=scope_id, deploy_ver=deploy_ver, pod_spec=pod_spec, identity=identity,
            on_created=on_created,
        )  # fmt: skip
        return await self._timed("deploy", call)

    async def await_ready(
        self,
        pod_id: str,
        namespace: str,
        pod_spec: dict[str, Any],
        *,
        uid: str,
        within: float,
        cluster: str | None = None,
    ) -> PodDeployInfo:
        call = self.inner.await_ready(
            pod_id, namespace, pod_spec, uid=uid, within=within, cluster=cluster
        )
        return await self._timed("await_ready", call)

    async def sign(
        self,
        pod_id: str,
        namespace: str,
        pod_spec: dict[str, Any],
        *,
        uid: str,
        annotations: dict[str, str],
        within: float,
        cluster: str | None = None,
    ) -> None:
        call = self.inner.sign(
            pod_id, namespace, pod_spec, uid=uid, annotations=annotations, within=within,
            cluster=cluster,
        )  # fmt: skip
        await self._timed("sign", call)

    async def delete(self, pod_id: str, namespace: str, *, cluster: str | None = None) -> bool:
        return await self._timed("delete", self.inner.delete(pod_id, namespace, cluster=cluster))

    async def get_pod(
        self, pod_id: str, namespace: str, *, cluster: str | None = None
    ) -> PodStatus | None:
        return await self._timed("get", self.inner.get_pod(pod_id, namespace, cluster=cluster))

    async def list_pods(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> list[PodStatus]:
        call = self.inner.list_pods(namespace, label_selector, cluster=cluster)
        return await self._timed("list", call)

    async def list_nodes(self, *, cluster: str | None = None) -> list[NodeStatus]:
        return await self._timed("list_nodes", self.inner.list_nodes(cluster=cluster))

    async def list_pods_versioned(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> PodListing:
        call = self.inner.list_pods_versioned(namespace, label_selector, cluster=cluster)
        return await self._timed("list", call)

    async def watch_pods(
        self,
        namespace: str,
        label_selector: str,
        *,
        resource_version: str,
        timeout_seconds: int,
        cluster: str | None = None,
    ) -> AsyncGenerator[PodEvent, None]:
        """Verb ``watch``, observed once when the stream ends, timed over its whole life;
        ended by the server or closed by its reader: ``ok``."""
        started = time.perf_counter()
        status = "error"
        # never current: the stream's reader runs between our yields, in its own context
        span = self._tracing.open_span("k8s watch", kind="client")
        try:
            inner = self.inner.watch_pods(
                namespace, label_selector, resource_version=resource_version,
                timeout_seconds=timeout_seconds, cluster=cluster,
            )  # fmt: skip
            async with contextlib.aclosing(inner) as events:
                async for event in events:
                    yield event
            status = "ok"
        except (GeneratorExit, asyncio.CancelledError):
            status = "ok"
            raise
        except K8sApiError as exc:
            status = str(exc.status) if exc.status else "error"
            raise
        finally:
            self._observe("watch", status, time.perf_counter() - started)
            span.set_attribute(K8S_OUTCOME, status)
            span.end()

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        return await self._timed("probe_health", self.inner.probe_health(pod_ip, port))
