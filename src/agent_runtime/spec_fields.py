"""Which template fields are deploy fields and which are policy, and the ``deploy_ver`` fingerprint.

Both modules must agree on a pod's version: the session side sunsets pods whose version is
not the template's, the resource side hands out only warm pods of the current version. So the
fingerprint is computed here, by one function, from one field list (contract §3).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# Baked into a running pod: a change needs new pods (the old ones are sunset).
DEPLOY_FIELDS: tuple[str, ...] = (
    "image",
    "pod_name",
    "namespace",
    "container_port",
    "sse_port",
    "sse_path",
    "cpu_request",
    "cpu_limit",
    "memory_request",
    "memory_limit",
    "env",
    "nfs_server",
    "nfs_path",
    "nfs_mount_path",
    "ready_timeout",
    "ready_poll_interval",
    "kubeconfig",
)

# kubeconfig only says where new pods are created; pods already running stay valid.
UNVERSIONED_DEPLOY_FIELDS: frozenset[str] = frozenset({"kubeconfig"})

DEPLOY_VER_FIELDS: tuple[str, ...] = tuple(
    f for f in DEPLOY_FIELDS if f not in UNVERSIONED_DEPLOY_FIELDS
)

# Govern capacity; a change takes effect at the next route, no pod is replaced.
POLICY_FIELDS: tuple[str, ...] = (
    "enabled",
    "scope_concurrency",
    "pod_concurrency",
    "session_ttl",
    "pod_ttl",
    "min_idle_pods",
    "warm_pool",
)


def deploy_subset(template: Mapping[str, Any]) -> dict[str, Any]:
    """The deploy fields of a template: what the resource manager needs to build a pod."""
    return {f: template.get(f) for f in DEPLOY_FIELDS}


def deploy_ver(template: Mapping[str, Any]) -> str:
    """First 16 hex of md5 over the versioned deploy fields, sorted by name, nulls dropped."""
    fields = {f: template[f] for f in DEPLOY_VER_FIELDS if template.get(f) is not None}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.md5(canonical.encode("utf-8")).hexdigest()[:16]


def classify_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``deploy`` if a deploy field differs, else ``policy`` if a policy field does, else ``none``.

    A kubeconfig-only change is ``deploy`` by class but leaves ``deploy_ver`` as it is, so it
    sunsets no pod: only new deploys use it.
    """
    if any(old.get(f) != new.get(f) for f in DEPLOY_FIELDS):
        return "deploy"
    if any(old.get(f) != new.get(f) for f in POLICY_FIELDS):
        return "policy"
    return "none"


REDACTED = "<redacted>"


def clear_env_values(pod_spec: Mapping[str, Any]) -> list[str]:
    """The plain env values of a template or pod spec (what logs and views must not show);
    ``valueFrom`` references carry no value."""
    env = pod_spec.get("env") or {}
    return [v for v in env.values() if isinstance(v, str)] if isinstance(env, dict) else []


def redacted_spec(pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    """``pod_spec`` with each plain env value replaced by ``<redacted>``: names and
    ``valueFrom`` references kept."""
    env = pod_spec.get("env")
    if not isinstance(env, dict):
        return dict(pod_spec)
    return {
        **pod_spec,
        "env": {k: REDACTED if isinstance(v, str) else v for k, v in env.items()},
    }
