"""``ResourceManagerFacade``: the only way the session manager reaches the resource manager."""

from __future__ import annotations

from typing import Any

from agent_runtime import spec_fields
from agent_runtime.resource_manager.state import ResourceState

POOL_CONFIG_FIELDS = ("min_idle_pods", "max_pods", "pod_ttl", "pod_concurrency")


class ResourceManagerFacade:
    def __init__(self, *, state: ResourceState) -> None:
        self._state = state

    async def update_pool_config(
        self, scope_id: str, pool_config: dict[str, int], pod_spec: dict[str, Any] | None = None
    ) -> dict[str, bool]:
        """Set the scope's pool parameters; with a pod spec also its ``deploy_ver``.

        The version is computed here from the spec (``spec_fields.deploy_ver``, the one
        function both modules use), so the two sides can never disagree on it.
        """
        missing = [f for f in POOL_CONFIG_FIELDS if f not in pool_config]
        if missing:
            raise ValueError(f"pool_config lacks {', '.join(missing)}")
        config = {f: int(pool_config[f]) for f in POOL_CONFIG_FIELDS}
        version = spec_fields.deploy_ver(pod_spec) if pod_spec is not None else None
        await self._state.write_pool_config(scope_id, config, deploy_ver=version, pod_spec=pod_spec)
        return {"updated": True}
