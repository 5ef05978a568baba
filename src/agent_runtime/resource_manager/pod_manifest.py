"""The pod a deploy creates (contract §5): its name, labels, container, readiness probe and
volumes, the SSE URL it serves, and the deploy's timing, all read from the template. Pure
functions (no cluster needed); ``k8s.py`` re-exports them.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from agent_runtime.resource_manager.models import (
    APP_LABEL,
    COMPONENT_LABEL,
    COMPONENT_VALUE,
    DEPLOY_VER_LABEL,
    SCOPE_LABEL,
    DeployFailed,
)

CONTAINER_NAME = "agentserver"
NFS_VOLUME = "nfs"
HEALTH_PATH = "/health"
PROBE_TIMEOUT = 3.0  # seconds for one GET /health (contract §5 half-dead rule)
# A pod_spec normally comes complete from a template; these fill a partial one (tests, tools).
DEFAULT_POD_NAME = "agent"
DEFAULT_PORT = 8080
DEFAULT_SSE_PATH = "/sse"
DEFAULT_READY_TIMEOUT = 300.0
DEFAULT_READY_POLL_INTERVAL = 2.0

_NAME_ALPHABET = string.ascii_lowercase + string.digits


def _random_chars(n: int) -> str:
    return "".join(secrets.choice(_NAME_ALPHABET) for _ in range(n))


def new_pod_name(pod_name: str | None) -> str:
    """``{pod_name}-{10}-{5}``: random, so a pod name never leaks a business id."""
    return f"{pod_name or DEFAULT_POD_NAME}-{_random_chars(10)}-{_random_chars(5)}"


def pod_labels(pod_id: str, scope_id: str, deploy_ver: str) -> dict[str, str]:
    """The labels watch, reconcile and cleanup select on (contract §5)."""
    return {
        COMPONENT_LABEL: COMPONENT_VALUE,
        APP_LABEL: pod_id,
        SCOPE_LABEL: scope_id,
        DEPLOY_VER_LABEL: deploy_ver,
    }


def sse_url(pod_ip: str, pod_spec: dict[str, Any]) -> str:
    port = pod_spec.get("sse_port") or DEFAULT_PORT
    return f"http://{pod_ip}:{port}{pod_spec.get('sse_path') or DEFAULT_SSE_PATH}"


def _resources(pod_spec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Requests and limits with only the quantities the template sets (K8s defaults the rest)."""
    out: dict[str, dict[str, str]] = {}
    for kind, field_kind in (("requests", "request"), ("limits", "limit")):
        quantities = {
            res: pod_spec[f"{res}_{field_kind}"]
            for res in ("cpu", "memory")
            if pod_spec.get(f"{res}_{field_kind}")
        }
        if quantities:
            out[kind] = quantities
    return out


def build_pod_body(
    pod_id: str,
    scope_id: str,
    deploy_ver: str,
    pod_spec: dict[str, Any],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Pod manifest (camelCase JSON) for ``create_namespaced_pod``; namespace is in the path.
    ``annotations``: the pod identity's (``PodIdentity.create_annotations``)."""
    if not pod_spec.get("image"):
        raise DeployFailed("pod_spec has no image")
    sse_port = int(pod_spec.get("sse_port") or DEFAULT_PORT)
    container_port = int(pod_spec.get("container_port") or sse_port)
    ports: list[dict[str, Any]] = [{"name": "sse", "containerPort": sse_port, "protocol": "TCP"}]
    if container_port != sse_port:
        ports.append({"name": "http", "containerPort": container_port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": pod_spec["image"],
        "ports": ports,
        # a string is a value; an object is a ``{"valueFrom": {"secretKeyRef": …}}`` reference
        "env": [
            {"name": k, "value": v} if isinstance(v, str) else {"name": k, **v}
            for k, v in sorted((pod_spec.get("env") or {}).items())
        ],
        # A short period so Ready shows soon after start; the timeout matches our own probe.
        "readinessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": sse_port},
            "periodSeconds": 2,
            "timeoutSeconds": int(PROBE_TIMEOUT),
        },
    }
    resources = _resources(pod_spec)
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"restartPolicy": "Always", "containers": [container]}
    if pod_spec.get("nfs_server") and pod_spec.get("nfs_path") and pod_spec.get("nfs_mount_path"):
        container["volumeMounts"] = [{"name": NFS_VOLUME, "mountPath": pod_spec["nfs_mount_path"]}]
        spec["volumes"] = [
            {
                "name": NFS_VOLUME,
                "nfs": {"server": pod_spec["nfs_server"], "path": pod_spec["nfs_path"]},
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_id,
            "labels": pod_labels(pod_id, scope_id, deploy_ver),
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
    }


def deploy_timing(pod_spec: dict[str, Any]) -> tuple[float, float]:
    """A deploy's ``ready_timeout`` and poll interval (never longer than the timeout)."""
    timeout = float(pod_spec.get("ready_timeout") or DEFAULT_READY_TIMEOUT)
    poll = float(pod_spec.get("ready_poll_interval") or DEFAULT_READY_POLL_INTERVAL)
    return timeout, min(poll, timeout)
