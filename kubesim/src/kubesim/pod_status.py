"""The status changes the simulated scheduler and kubelet write on a pod (core/v1
``PodStatus``: conditions, container statuses, phase), and a deletion's mark."""

from __future__ import annotations

import secrets
from typing import Any

from kubesim.store import Obj, timestamp

NODE_NAME = "kubesim-node"
HOST_IP = "127.0.0.1"
_CONDITIONS = (
    "PodReadyToStartContainers",
    "Initialized",
    "Ready",
    "ContainersReady",
    "PodScheduled",
)


# --- status changes (scheduler and kubelet) -----------------------------------------------------


def _condition(
    pod: Obj, kind: str, status: bool, reason: str | None = None, message: str = ""
) -> None:
    conditions: list[dict[str, Any]] = pod["status"].setdefault("conditions", [])
    value = "True" if status else "False"
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is None:
        current = {"type": kind, "status": value, "lastProbeTime": None}
        conditions.append(current)
        conditions.sort(key=lambda c: _CONDITIONS.index(c["type"]))
    elif current["status"] == value and current.get("reason") == reason:
        return
    current["status"] = value
    current["lastTransitionTime"] = timestamp()
    for key, text in (("reason", reason), ("message", message)):
        if text:
            current[key] = text
        else:
            current.pop(key, None)


def is_ready(pod: Obj) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def scheduled(pod: Obj, node: str = NODE_NAME) -> None:
    pod["spec"]["nodeName"] = node
    _condition(pod, "PodScheduled", True)


def unschedulable(pod: Obj, message: str | None = None) -> None:
    _condition(
        pod,
        "PodScheduled",
        False,
        "Unschedulable",
        message
        or "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available: "
        "1 No preemption victims found for incoming pod.",
    )


def sandbox_ready(pod: Obj, ip: str) -> None:
    """Network and volumes are up: an IP, containers being created, not Ready."""
    status = pod["status"]
    status.update(
        hostIP=HOST_IP,
        hostIPs=[{"ip": HOST_IP}],
        podIP=ip,
        podIPs=[{"ip": ip}],
        startTime=timestamp(),
    )
    _condition(pod, "PodReadyToStartContainers", True)
    _condition(pod, "Initialized", True)
    _not_ready(pod)
    for cs in container_statuses(pod):
        cs["state"] = {"waiting": {"reason": "ContainerCreating"}}


def _not_ready(pod: Obj) -> None:
    names = ",".join(c["name"] for c in pod["spec"]["containers"])
    message = f"containers with unready status: [{names}]"
    _condition(pod, "Ready", False, "ContainersNotReady", message)
    _condition(pod, "ContainersReady", False, "ContainersNotReady", message)


def container_statuses(pod: Obj) -> list[dict[str, Any]]:
    status = pod["status"]
    if "containerStatuses" not in status:
        status["containerStatuses"] = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "started": False,
                "state": {"waiting": {"reason": "ContainerCreating"}},
                "lastState": {},
            }
            for c in pod["spec"]["containers"]
        ]
    statuses: list[dict[str, Any]] = status["containerStatuses"]
    return statuses


def _container_id() -> str:
    return f"containerd://{secrets.token_hex(32)}"


def waiting(pod: Obj, reason: str, message: str) -> None:
    """Containers stuck before running (image pull); phase stays Pending."""
    for cs in container_statuses(pod):
        cs.update(ready=False, started=False)
        cs["state"] = {"waiting": {"reason": reason, "message": message}}
    _not_ready(pod)


def running(pod: Obj, ready: bool) -> None:
    pod["status"]["phase"] = "Running"
    for cs in container_statuses(pod):
        if "running" not in cs["state"]:
            cs["state"] = {"running": {"startedAt": timestamp()}}
            cs["containerID"] = _container_id()
            cs["imageID"] = f"{cs['image'].split(':')[0]}@sha256:{secrets.token_hex(32)}"
        cs.update(ready=ready, started=True)
    set_ready(pod, ready)


def set_ready(pod: Obj, ready: bool) -> None:
    if ready:
        _condition(pod, "Ready", True)
        _condition(pod, "ContainersReady", True)
    else:
        _not_ready(pod)
    for cs in pod["status"].get("containerStatuses") or []:
        cs["ready"] = ready and "running" in cs["state"]


def crash_loop(pod: Obj, exit_code: int, message: str = "") -> None:
    """The container exited and the kubelet backs off restarting it; phase Running (restart
    policy Always), never Ready."""
    pod["status"]["phase"] = "Running"
    name = pod["metadata"]["name"]
    for cs in container_statuses(pod):
        now = timestamp()
        cs["restartCount"] = int(cs.get("restartCount", 0)) + 1
        cs["lastState"] = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Error",
                "message": message,
                "startedAt": now,
                "finishedAt": now,
                "containerID": cs.get("containerID") or _container_id(),
            }
        }
        cs["state"] = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off 10s restarting failed container={cs['name']} pod={name}",
            }
        }
        cs.update(ready=False, started=False)
    _not_ready(pod)


def failed(pod: Obj, reason: str, message: str, exit_code: int = 137) -> None:
    """The pod is over: phase Failed, containers terminated."""
    status = pod["status"]
    status.update(phase="Failed", reason=reason, message=message)
    for cs in container_statuses(pod):
        started = cs["state"].get("running", {}).get("startedAt") or timestamp()
        cs["state"] = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Error",
                "startedAt": started,
                "finishedAt": timestamp(),
                "containerID": cs.get("containerID") or _container_id(),
            }
        }
        cs.update(ready=False, started=False)
    _not_ready(pod)


def mark_deleting(pod: Obj, grace_seconds: int, wait: float) -> None:
    """A graceful delete began: deletionTimestamp (when it will be gone), no longer Ready."""
    meta = pod["metadata"]
    meta["deletionTimestamp"] = timestamp(wait)
    meta["deletionGracePeriodSeconds"] = grace_seconds
    if "conditions" in pod["status"]:
        _not_ready(pod)
        for cs in pod["status"].get("containerStatuses") or []:
            cs["ready"] = False
