"""The simulator's etcd: namespaces, pods and nodes as JSON objects, one ``resourceVersion``
counter.

Everything here is synchronous and runs on the event loop, so each change is atomic. Reads hand
out deep copies: no caller can change a stored object behind the store's back. Every write
bumps the object's ``metadata.resourceVersion`` from the one global counter, as etcd does, and
every write of a pod or a node is published (``publish(resource, type, copy)``: the watch
history, ``watch.py``) with that version: ``ADDED``, ``MODIFIED``, ``DELETED`` (the object as
it was, carrying the deletion's version).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from kubesim.errors import already_exists, not_found
from kubesim.labels import FieldRequirement, Selector, fields_match

Obj = dict[str, Any]
Publish = Callable[[str, str, Obj], None]


def _ignore(resource: str, type_: str, obj: Obj) -> None:
    return None


def timestamp(after: float = 0.0) -> str:
    """RFC 3339 in UTC with whole seconds, as the API server writes times."""
    moment = datetime.now(UTC) + timedelta(seconds=after)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def new_uid() -> str:
    return str(uuid.uuid4())


def _by_key(entry: tuple[tuple[str, str], Obj]) -> tuple[str, str]:
    return entry[0]


class Store:
    def __init__(self, publish: Publish = _ignore) -> None:
        self._rv = 1000
        self.namespaces: dict[str, Obj] = {}
        self._pods: dict[tuple[str, str], Obj] = {}
        self.nodes: dict[str, Obj] = {}
        self.publish = publish

    # --- versions ---------------------------------------------------------------------------

    def _bump(self, obj: Obj) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def stamp(self, obj: Obj) -> None:
        """Give an object kept outside this store (an event) the next resourceVersion."""
        self._bump(obj)

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def revision(self) -> int:
        return self._rv

    def _deleted(self, resource: str, obj: Obj) -> None:
        """A delete is a write: it takes a version of its own, which its event carries."""
        self._bump(obj)
        self.publish(resource, "DELETED", obj)

    # --- namespaces -------------------------------------------------------------------------

    def add_namespace(self, name: str) -> Obj:
        existing = self.namespaces.get(name)
        if existing is not None:
            return copy.deepcopy(existing)
        obj: Obj = {
            "kind": "Namespace",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "uid": new_uid(),
                "creationTimestamp": timestamp(),
                "labels": {"kubernetes.io/metadata.name": name},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }
        self._bump(obj)
        self.namespaces[name] = obj
        return copy.deepcopy(obj)

    def remove_namespace(self, name: str) -> list[str]:
        """Drop a namespace and its pods; returns the names of the pods dropped."""
        self.namespaces.pop(name, None)
        gone = sorted(key for key in self._pods if key[0] == name)
        for key in gone:
            self._deleted("pods", self._pods.pop(key))
        return [pod_name for _, pod_name in gone]

    # --- pods -------------------------------------------------------------------------------

    def create_pod(self, pod: Obj) -> Obj:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if key in self._pods:
            raise already_exists("pods", meta["name"])
        stored = copy.deepcopy(pod)
        self._bump(stored)
        self._pods[key] = stored
        self.publish("pods", "ADDED", copy.deepcopy(stored))
        return copy.deepcopy(stored)

    def get_pod(self, namespace: str, name: str) -> Obj | None:
        pod = self._pods.get((namespace, name))
        return copy.deepcopy(pod) if pod is not None else None

    def require_pod(self, namespace: str, name: str) -> Obj:
        pod = self.get_pod(namespace, name)
        if pod is None:
            raise not_found("pods", name)
        return pod

    def has_pod(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self._pods

    def pod_uid(self, namespace: str, name: str) -> str | None:
        pod = self._pods.get((namespace, name))
        return pod["metadata"]["uid"] if pod is not None else None

    def list_pods(
        self,
        namespace: str | None,
        selector: Selector | None = None,
        fields: list[FieldRequirement] | None = None,
    ) -> list[Obj]:
        """Matching pods, ordered by namespace then name (as etcd's key order)."""
        return [
            copy.deepcopy(pod)
            for _, pod in sorted(self.iter_pods(namespace, selector, fields), key=_by_key)
        ]

    def iter_pods(
        self,
        namespace: str | None,
        selector: Selector | None = None,
        fields: list[FieldRequirement] | None = None,
    ) -> Iterator[tuple[tuple[str, str], Obj]]:
        """``((namespace, name), pod)`` of the matching pods, unordered and NOT copied: for a
        reader that serialises them at once and changes nothing (a LIST page's snapshot)."""
        for key, pod in self._pods.items():
            if namespace is not None and key[0] != namespace:
                continue
            if selector is not None and not selector.matches(pod["metadata"].get("labels")):
                continue
            if fields and not fields_match(fields, pod):
                continue
            yield key, pod

    def pods(self) -> Iterator[tuple[str, str]]:
        yield from sorted(self._pods)

    def update_pod(
        self, namespace: str, name: str, change: Callable[[Obj], None], *, uid: str | None = None
    ) -> Obj | None:
        """Apply ``change`` to the stored pod (only the incarnation ``uid`` when given) and bump
        its resourceVersion; None when the pod is gone (or was replaced)."""
        pod = self._pods.get((namespace, name))
        if pod is None or (uid is not None and pod["metadata"]["uid"] != uid):
            return None
        before = copy.deepcopy(pod)
        change(pod)
        if pod != before:
            self._bump(pod)
            self.publish("pods", "MODIFIED", copy.deepcopy(pod))
        return copy.deepcopy(pod)

    def remove_pod(self, namespace: str, name: str, *, uid: str | None = None) -> Obj | None:
        pod = self._pods.get((namespace, name))
        if pod is None or (uid is not None and pod["metadata"]["uid"] != uid):
            return None
        del self._pods[(namespace, name)]
        self._deleted("pods", pod)
        return copy.deepcopy(pod)

    # --- nodes ------------------------------------------------------------------------------

    def add_node(self, node: Obj) -> Obj:
        stored = copy.deepcopy(node)
        name = stored["metadata"]["name"]
        if name in self.nodes:
            raise already_exists("nodes", name)
        self._bump(stored)
        self.nodes[name] = stored
        self.publish("nodes", "ADDED", copy.deepcopy(stored))
        return copy.deepcopy(stored)

    def get_node(self, name: str) -> Obj | None:
        node = self.nodes.get(name)
        return copy.deepcopy(node) if node is not None else None

    def require_node(self, name: str) -> Obj:
        node = self.get_node(name)
        if node is None:
            raise not_found("nodes", name)
        return node

    def list_nodes(
        self, selector: Selector | None = None, fields: list[FieldRequirement] | None = None
    ) -> list[Obj]:
        return [
            copy.deepcopy(node)
            for name, node in sorted(self.nodes.items())
            if (selector is None or selector.matches(node["metadata"].get("labels")))
            and (not fields or fields_match(fields, node))
        ]

    def update_node(self, name: str, change: Callable[[Obj], None]) -> Obj:
        """Apply ``change`` to the stored node; the version bumps (and MODIFIED is published)
        when something changed."""
        node = self.nodes.get(name)
        if node is None:
            raise not_found("nodes", name)
        before = copy.deepcopy(node)
        change(node)
        if node != before:
            self._bump(node)
            self.publish("nodes", "MODIFIED", copy.deepcopy(node))
        return copy.deepcopy(node)

    def pods_per_node(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for pod in self._pods.values():
            node = pod["spec"].get("nodeName")
            if node:
                counts[node] = counts.get(node, 0) + 1
        return counts
