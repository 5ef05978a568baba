"""The fake Kubernetes' watch: every change to a fake cluster's pods is an event with a
``resourceVersion``, kept in a bounded history that a watch resumes from.

``PodSet`` is a cluster's pods (a dict: the fake and the tests change it as before); each
``pods[name] = pod``, ``del``, ``pop`` or ``clear`` is recorded in the ``EventLog`` the fake's
clusters share (one version sequence). A watch resumes from any version the history still
holds; older ones were compacted (``EventLog.compact``, or the history's bound): 410, as the
API server answers. ``EventLog.drop`` ends every open stream (a dropped connection): its
reader resumes from its last version.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from agent_runtime.resource_manager.models import K8sApiError, PodEvent, PodStatus

HISTORY = 10_000  # events a cluster keeps to resume from; older versions are compacted


class EventLog:
    """The versions and per-cluster histories of a fake's pod sets, and its open streams."""

    def __init__(self) -> None:
        self.version = 0
        self._history: dict[str | None, deque[tuple[int, str, PodStatus]]] = {}
        self._floor: dict[str | None, int] = {}  # versions below it are compacted
        self._wakers: set[asyncio.Event] = set()
        self._drops = 0

    def record(self, cluster: str | None, kind: str, pod: PodStatus) -> None:
        self.version += 1
        history = self._history.setdefault(cluster, deque())
        history.append((self.version, kind, pod))
        if len(history) > HISTORY:
            self._floor[cluster] = history.popleft()[0]
        self._wake()

    def compact(self) -> None:
        """Every history dropped: a watch resuming from any version before now gets 410."""
        for cluster, history in self._history.items():
            history.clear()
            self._floor[cluster] = self.version
        self._floor[None] = self.version

    def drop(self) -> None:
        """End every open stream (as a dropped connection would)."""
        self._drops += 1
        self._wake()

    def _wake(self) -> None:
        for waker in self._wakers:
            waker.set()

    async def stream(
        self,
        cluster: str | None,
        version: str,
        seconds: float,
        wanted: Callable[[PodStatus], bool],
    ) -> AsyncGenerator[PodEvent, None]:
        try:  # "0" (or none): from now (the API server would first replay the pods as ADDED)
            cursor = int(version) if version not in ("", "0") else self.version
        except ValueError:
            raise K8sApiError(
                f"fake: resourceVersion {version[:40]!r} is not valid", status=400
            ) from None
        drops = self._drops
        waker = asyncio.Event()
        self._wakers.add(waker)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            while True:
                waker.clear()
                if self._drops != drops:
                    return
                if cursor < self._floor.get(cluster, 0):
                    raise K8sApiError("fake: too old resource version (compacted)", status=410)
                fresh = [e for e in self._history.get(cluster, ()) if e[0] > cursor]
                for number, kind, pod in fresh:
                    cursor = number
                    if wanted(pod):
                        yield PodEvent(kind, pod, str(number))
                if fresh:
                    continue  # the reader may have taken its time: look again before waiting
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return
                try:
                    await asyncio.wait_for(waker.wait(), remaining)
                except TimeoutError:
                    return
        finally:
            self._wakers.discard(waker)


class PodSet(dict[str, PodStatus]):
    """A fake cluster's pods; every change is recorded in its ``EventLog``."""

    def __init__(self, log: EventLog, cluster: str | None) -> None:
        super().__init__()
        self._log = log
        self._cluster = cluster

    def __setitem__(self, name: str, pod: PodStatus) -> None:
        kind = "MODIFIED" if name in self else "ADDED"
        super().__setitem__(name, pod)
        self._log.record(self._cluster, kind, pod)

    def __delitem__(self, name: str) -> None:
        pod = self[name]
        super().__delitem__(name)
        self._log.record(self._cluster, "DELETED", pod)

    def pop(self, name: str, *default: Any) -> Any:
        if name in self:
            pod = super().pop(name)
            self._log.record(self._cluster, "DELETED", pod)
            return pod
        return super().pop(name, *default)

    def clear(self) -> None:
        for name in list(self):
            del self[name]
