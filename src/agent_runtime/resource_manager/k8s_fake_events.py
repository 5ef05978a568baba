"""``FakeEvents``: the core/v1 Events the fake Kubernetes keeps (local mode and the tests), so
what the recorder sent can be read back: bounded (the oldest write goes first), refused as the
real API refuses (403 in a forbidden namespace, 404 in a missing one or for a patch of an event
that is not there, 409 for a name taken).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from agent_runtime.resource_manager.models import K8sApiError

FAKE_EVENTS_KEPT = 1000  # events the fake keeps, over every cluster


class FakeEvents:
    """Events by (cluster, namespace, name), the last written last."""

    def __init__(self, *, kept: int = FAKE_EVENTS_KEPT) -> None:
        self._kept = kept
        self._events: OrderedDict[tuple[str | None, str, str], dict[str, Any]] = OrderedDict()
        self.refuse_status: int | None = None  # every call answers this status (a fault knob)

    def _check(self, namespace: str, forbidden: set[str], missing: set[str]) -> None:
        if self.refuse_status is not None:
            raise K8sApiError("fake: events refused", status=self.refuse_status)
        if namespace in forbidden:
            raise K8sApiError(f"fake: events in {namespace} are forbidden", status=403)
        if namespace in missing:
            raise K8sApiError(f"fake: namespace {namespace} not found", status=404)

    def create(
        self,
        cluster: str | None,
        namespace: str,
        body: dict[str, Any],
        *,
        forbidden: set[str],
        missing: set[str],
    ) -> None:
        self._check(namespace, forbidden, missing)
        key = (cluster, namespace, str(body["metadata"]["name"]))
        if key in self._events:
            raise K8sApiError(f"fake: event {key[2]} already exists", status=409)
        self._events[key] = copy.deepcopy(body)
        while len(self._events) > self._kept:
            self._events.popitem(last=False)

    def patch(
        self,
        cluster: str | None,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        forbidden: set[str],
        missing: set[str],
    ) -> None:
        self._check(namespace, forbidden, missing)
        key = (cluster, namespace, name)
        event = self._events.get(key)
        if event is None:
            raise K8sApiError(f"fake: event {name} not found", status=404)
        event.update(copy.deepcopy(patch))
        self._events.move_to_end(key)

    def of_pod(self, pod_id: str, *, cluster: str | None = None) -> list[dict[str, Any]]:
        """The events recorded on a pod (by name), oldest write first; copies."""
        return [
            copy.deepcopy(event)
            for (where, _, _), event in self._events.items()
            if where == cluster and event["involvedObject"]["name"] == pod_id
        ]

    def all(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(event) for event in self._events.values()]

    def forget(self, cluster: str | None, namespace: str, name: str) -> None:
        """The event expires (the API server's TTL): a later patch of it is 404."""
        self._events.pop((cluster, namespace, name), None)
