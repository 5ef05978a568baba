"""Resource manager state in Redis: the only module that knows the ``resource_manager:`` keys."""

from __future__ import annotations

import json
from typing import Any, cast

from redis.asyncio import Redis

from agent_runtime.config import RM_KEY_PREFIX as P


def scope_config_key(scope_id: str) -> str:
    return f"{P}resource:scope:{scope_id}:config"


class ResourceState:
    """Typed operations on the resource manager's Redis keys (client with decode_responses)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def write_pool_config(
        self,
        scope_id: str,
        pool_config: dict[str, int],
        *,
        deploy_ver: str | None = None,
        pod_spec: dict[str, Any] | None = None,
    ) -> None:
        """One HSET: pool parameters, and with a pod spec also its version (atomic together)."""
        fields: dict[str, str] = {k: str(int(v)) for k, v in pool_config.items()}
        if pod_spec is not None:
            assert deploy_ver is not None
            fields["deploy_ver"] = deploy_ver
            fields["pod_spec_json"] = json.dumps(pod_spec, sort_keys=True, separators=(",", ":"))
        await self.redis.hset(scope_config_key(scope_id), mapping=cast(dict[Any, Any], fields))

    async def pool_config(self, scope_id: str) -> dict[str, str]:
        return cast(dict[str, str], await self.redis.hgetall(scope_config_key(scope_id)))
