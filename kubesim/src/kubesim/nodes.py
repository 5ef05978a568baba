"""The simulated nodes and the scheduler's choice among them.

``count`` nodes exist from the start: the first is ``kubesim-node`` (the one node of earlier
versions, so nothing that knew it breaks), then ``kubesim-node-2``, ``kubesim-node-3``, …
A Node object is minimal but real (core/v1: labels as the kubelet sets them, ``Ready`` condition,
addresses, capacity, ``nodeInfo``), so kubernetes_asyncio deserialises it as ``V1Node``.

Cordon is ``spec.unschedulable: true`` (what ``kubectl cordon`` patches), with the
``node.kubernetes.io/unschedulable:NoSchedule`` taint the node lifecycle controller adds (here
in the same write). The scheduler puts a new pod on the schedulable node that runs the fewest
pods (ties: the node's order), never on a cordoned one; with none schedulable the pod stays
Pending, ``PodScheduled`` False ``Unschedulable``, until a node changes. Cordoning moves nothing
that runs already, as in Kubernetes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kubesim.errors import bad_request, conflict, invalid
from kubesim.pod_status import HOST_IP, NODE_NAME
from kubesim.pods import merge_patch, meta_map_causes
from kubesim.store import Obj, Store, new_uid, timestamp

UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
MAX_NODES = 1000  # input bound: a simulator, not a cluster


def node_name(index: int) -> str:
    """The name of node ``index`` (0-based): ``kubesim-node``, ``kubesim-node-2``, …"""
    return NODE_NAME if index == 0 else f"{NODE_NAME}-{index + 1}"


def build_node(name: str) -> Obj:
    now = timestamp()
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": new_uid(),
            "creationTimestamp": now,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux",
                "beta.kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "kubesim",
            },
        },
        "spec": {},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": name},
            ],
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": new_uid(),
                "containerRuntimeVersion": "containerd://1.7.20",
                "kernelVersion": "6.1.0",
                "kubeProxyVersion": "v1.31.0-kubesim",
                "kubeletVersion": "v1.31.0-kubesim",
                "machineID": new_uid().replace("-", ""),
                "operatingSystem": "linux",
                "osImage": "kubesim",
                "systemUUID": new_uid(),
            },
        },
    }


def _set_unschedulable(node: Obj, flag: bool) -> None:
    spec = node["spec"]
    taints = [t for t in spec.get("taints") or [] if t.get("key") != UNSCHEDULABLE_TAINT]
    if flag:
        spec["unschedulable"] = True
        taint = {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule", "timeAdded": timestamp()}
        taints.append(taint)
    else:
        spec.pop("unschedulable", None)
    if taints:
        spec["taints"] = taints
    else:
        spec.pop("taints", None)


def schedulable(node: Obj) -> bool:
    if node["spec"].get("unschedulable"):
        return False
    conditions = node["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def patched(node: Obj, patch: Any) -> tuple[dict[str, Any], bool | None]:
    """What a merge (or strategic merge) patch of a node asks: the labels and annotations it
    leaves, and ``spec.unschedulable`` (None: not touched). 400 for a body that is no object,
    409 for a stale ``resourceVersion``, 422 for anything else changed (kubesim's own limit)."""
    if not isinstance(patch, dict):
        raise bad_request("the body of the request was in an unknown format")
    name = node["metadata"]["name"]
    given = patch.get("metadata")
    version = given.get("resourceVersion") if isinstance(given, dict) else None
    if version is not None and version != node["metadata"].get("resourceVersion"):
        raise conflict("nodes", name)
    spec = patch.get("spec")
    unschedulable: bool | None = None
    if isinstance(spec, dict) and "unschedulable" in spec:
        value = spec["unschedulable"]
        if value is not None and not isinstance(value, bool):
            field = "spec.unschedulable"
            raise invalid("Node", name, [(field, "FieldValueInvalid", f"{field}: not a bool")])
        unschedulable = bool(value)
    others = {k for k in patch if k not in ("metadata", "spec")}
    spec_others = {k for k in spec if k != "unschedulable"} if isinstance(spec, dict) else set()
    meta_others = (
        {k for k in given if k not in ("labels", "annotations", "resourceVersion")}
        if isinstance(given, dict)
        else set()
    )
    if others or spec_others or meta_others or (spec is not None and not isinstance(spec, dict)):
        message = (
            "Forbidden: kubesim lets a node patch change spec.unschedulable, "
            "metadata.labels and metadata.annotations only"
        )
        raise invalid("Node", name, [("spec", "FieldValueForbidden", message)])
    meta = {
        key: node["metadata"].get(key) or {} for key in ("labels", "annotations")
    }  # what the merge of the two maps leaves
    if isinstance(given, dict):
        meta = merge_patch(meta, {k: v for k, v in given.items() if k != "resourceVersion"})
    causes = meta_map_causes(meta)
    if causes:
        raise invalid("Node", name, causes)
    return meta, unschedulable


class Nodes:
    """The nodes of one simulator, and the scheduler's view of them."""

    def __init__(self, store: Store, count: int) -> None:
        if not 1 <= count <= MAX_NODES:
            raise ValueError(f"nodes must be between 1 and {MAX_NODES}")
        self._store = store
        self._order = [node_name(i) for i in range(count)]
        for name in self._order:
            store.add_node(build_node(name))
        self._changed = asyncio.Event()

    @property
    def names(self) -> list[str]:
        return list(self._order)

    def pick(self) -> str | None:
        """The schedulable node running the fewest pods (ties: node order), or None."""
        load = self._store.pods_per_node()
        candidates = [
            name
            for name in self._order
            if (node := self._store.nodes.get(name)) is not None and schedulable(node)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda name: (load.get(name, 0), self._order.index(name)))

    def unschedulable_message(self) -> str:
        total = len(self._order)
        return (
            f"0/{total} nodes are available: {total} node(s) were unschedulable. "
            f"preemption: 0/{total} nodes are available: {total} Preemption is not helpful "
            "for scheduling."
        )

    async def changed(self) -> None:
        """Until the next change of any node (a cordon lifted: pending pods try again)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def cordon(self, name: str, flag: bool = True) -> Obj:
        node = self._store.update_node(name, lambda n: _set_unschedulable(n, flag))
        self._notify()
        return node

    def patch(self, name: str, patch: Any) -> Obj:
        current = self._store.require_node(name)
        meta, unschedulable = patched(current, patch)

        def apply(node: Obj) -> None:
            for key, value in meta.items():
                if value:
                    node["metadata"][key] = value
                else:
                    node["metadata"].pop(key, None)
            if unschedulable is not None:
                _set_unschedulable(node, unschedulable)

        node = self._store.update_node(name, apply)
        self._notify()
        return node

    def uncordon_all(self) -> None:
        for name in self._order:
            if self._store.nodes[name]["spec"].get("unschedulable"):
                self.cordon(name, False)

    def describe(self) -> list[dict[str, Any]]:
        load = self._store.pods_per_node()
        return [
            {
                "name": name,
                "unschedulable": bool(node["spec"].get("unschedulable")),
                "ready": schedulable({"spec": {}, "status": node["status"]}),
                "pods": load.get(name, 0),
                "resourceVersion": node["metadata"]["resourceVersion"],
            }
            for name in self._order
            if (node := self._store.nodes.get(name)) is not None
        ]
