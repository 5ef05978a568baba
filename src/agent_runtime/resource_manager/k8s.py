"""The Kubernetes adapter: ``RealK8sPodClient`` (kubernetes_asyncio) and ``FakeK8sPodClient``.

This file holds the client lifecycle; the pod operations (deploy, delete, list, probe) arrive
with the resource manager's acquire and jobs. Hazard: ``load_incluster_config`` is a plain
function, ``load_kube_config`` a coroutine; awaiting the first is a TypeError in-cluster.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

log = logging.getLogger(__name__)


class K8sPodClient(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...


class RealK8sPodClient:
    """One shared API client: in-cluster service account first, else a kubeconfig."""

    def __init__(self, *, kubeconfig: str | None = None) -> None:
        self._kubeconfig = kubeconfig
        self.api_client: Any = None
        self.source: str | None = None

    async def start(self) -> None:
        from kubernetes_asyncio import client, config
        from kubernetes_asyncio.config import ConfigException

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
            self.source = "in-cluster"
        except ConfigException:
            await config.load_kube_config(
                config_file=self._kubeconfig, client_configuration=configuration
            )
            self.source = f"kubeconfig {self._kubeconfig or '~/.kube/config'}"
        self.api_client = client.ApiClient(configuration=configuration)
        log.info("kubernetes client ready (%s)", self.source)

    async def close(self) -> None:
        if self.api_client is not None:
            await self.api_client.close()
            self.api_client = None


class FakeK8sPodClient:
    """In-process stand-in for local mode and tests."""

    def __init__(self) -> None:
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False
